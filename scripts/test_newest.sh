#!/usr/bin/env bash
# CI's second leg: the newest torch release, in its own venv (.venv-newest/, created or reused by
# scripts/setup_newest.sh: torch 2.15.0, torchtitan 0.3.0). With no arguments: the default suite's files that
# depend on the torch release (the compat checks, the core and its compiled paths, DTensor, checkpoints, torch's
# API, the doors' SDPA mode, the transformers attention interface compiled) -- leg 1 runs every file on the dev
# pin, and the files left out here exercise transformers, torchtitan 0.2.2 or torch-free code the same way on
# either release. Arguments go to pytest instead (tests/titan/v03: torchtitan 0.3).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_newest.sh
venv=.venv-newest
if [ "${CP_DTENSOR_FLA:-0}" = 1 ]; then  # fla beside the venv (scripts/setup_newest.sh): only these tests see it
  export PYTHONPATH="$PWD/$venv/fla-side${PYTHONPATH:+:$PYTHONPATH}"
fi
"$venv/bin/python" -c 'import torch; print(f"newest leg: torch {torch.__version__}")'
if [ "$#" -eq 0 ]; then
  set -- tests/test_compat.py tests/test_import.py tests/test_extras.py tests/test_public_api.py \
    tests/test_torch_api.py tests/test_doors.py tests/test_documents_doors.py tests/core tests/dtensor \
    tests/checkpoint tests/hf/test_hf_attention.py tests/hf/test_hf_compile.py
fi
exec "$venv/bin/python" -m pytest -q "$@"
