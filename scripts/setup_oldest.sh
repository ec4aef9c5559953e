#!/usr/bin/env bash
# The oldest stack's venv (.venv-oldest/, created or reused): requirements/oldest.txt -- torch 2.11.0 (the GPU
# image's torch; PyPI's CUDA build, ~4.6 GB installed, it runs on CPU), the core's one dependency (safetensors),
# pytest, hypothesis and numpy (the tests' reference helpers); no extra (the leg covers the core and the DTensor
# layer). PIP_CONFIG_FILE=/dev/null lifts the machine's pip configuration (which caps torch at the releases
# stored locally) for this venv only. scripts/test_oldest.sh calls this; .ci/run runs it in the background, after
# leg 2's, while leg 1 tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-oldest
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp=$venv/.cp_dtensor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/oldest.txt -nt "$stamp" ]; then
  PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -c requirements/oldest.txt -e . pytest hypothesis numpy
  touch "$stamp"
fi
