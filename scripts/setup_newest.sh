#!/usr/bin/env bash
# The second stack's venv (.venv-newest/, created or reused): requirements/newest.txt -- torch 2.15.0 (PyPI's
# CUDA build, ~5 GB; it runs on CPU), transformers, torchao, accelerate, trl and torchtitan 0.3.0. pip's
# machine-wide configuration here caps torch at the releases stored locally; PIP_CONFIG_FILE=/dev/null lifts
# that for this venv only. CP_DTENSOR_FLA=1 also puts fla beside it (see below). scripts/test_newest.sh calls
# this; .ci/run runs it in the background while leg 1 tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-newest
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp=$venv/.cp_dtensor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/newest.txt -nt "$stamp" ]; then
  PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -c requirements/newest.txt -e '.[titan,float8,hf,trainer,test,bench]'
  touch "$stamp"
fi
if [ "${CP_DTENSOR_FLA:-0}" = 1 ]; then
  # fla (flash-linear-attention), which torchtitan 0.3's qwen3_5 imports, beside the venv rather than in it:
  # with fla importable, transformers 5.24 sends its own CPU Gated DeltaNet/KDA to fla's Triton kernels, which
  # cannot run on CPU. So only the torchtitan 0.3 tests see it (.ci/run), through PYTHONPATH.
  fla=$venv/fla-side
  if [ ! -d "$fla/fla" ]; then
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      --target "$fla" flash-linear-attention==0.6.0 fla-core==0.6.0
  fi
fi
