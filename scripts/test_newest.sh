#!/usr/bin/env bash
# CI's second leg: the default suite on the newest torch release, in its own venv (.venv-newest/, created or
# reused by scripts/setup_newest.sh: torch 2.15.0, torchtitan 0.3.0 -- tests/titan/v03/test_titan03.py runs,
# the 0.2.2 TOML plugin's tests skip). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_newest.sh
venv=.venv-newest
if [ "${CP_DTENSOR_FLA:-0}" = 1 ]; then  # fla beside the venv (scripts/setup_newest.sh): only these tests see it
  export PYTHONPATH="$PWD/$venv/fla-side${PYTHONPATH:+:$PYTHONPATH}"
fi
"$venv/bin/python" -c 'import torch; print(f"newest leg: torch {torch.__version__}")'
exec "$venv/bin/python" -m pytest -q "$@"  # no path given: pyproject's testpaths (tests/)
