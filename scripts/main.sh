#!/usr/bin/env bash
# The main job: set up .venv/ (create or reuse), then train torchtitan's llama3 debug model with
# context parallelism (cp_dtensor striped ring attention) on CPU ranks, from the shipped TOML,
# tokenizer and data. Extra arguments go to torchtitan, e.g. --parallelism.context_parallel_degree 4.
# NPROC: ranks (default 2). LOG_RANK: the local ranks whose log is shown (default the last, NPROC - 1: under
# pipeline parallelism the last stage's ranks log the loss; torchtitan logs a placeholder on the others).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
NPROC=${NPROC:-2}
exec .venv/bin/torchrun --standalone --nproc_per_node="$NPROC" --local-ranks-filter "${LOG_RANK:-$((NPROC - 1))}" \
    -m cp_dtensor.titan.train --job.config_file titan_configs/llama3_debug.toml "$@"
