#!/usr/bin/env bash
# CI's third leg: the core on the oldest torch cp_dtensor supports (torch 2.11.0, the GPU image's), in its own venv
# (.venv-oldest/, created or reused by scripts/setup_oldest.sh): the compat checks, the ring, the masks (their
# compiled case included) and the DTensor placements and SDPA rule. Arguments replace the file list.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_oldest.sh
venv=.venv-oldest
"$venv/bin/python" -c 'import torch; print(f"oldest leg: torch {torch.__version__}")'
if [ "$#" -eq 0 ]; then
  set -- tests/test_compat.py tests/test_import.py tests/core/test_ring.py tests/core/test_masks.py \
    tests/dtensor/test_sdpa.py tests/dtensor/test_placements.py
fi
exec "$venv/bin/python" -m pytest -q "$@"
