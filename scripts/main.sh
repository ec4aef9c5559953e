#!/usr/bin/env bash
# The main job: set up .venv/ (create or reuse), then run context-parallel work on 4 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node=4 scripts/demo.py "$@"
