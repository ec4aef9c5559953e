#!/usr/bin/env bash
# The main job: set up .venv/ (create or reuse), then train torchtitan's llama3 debug model with
# context parallelism (cp_dtensor striped ring attention) on CPU ranks, from the shipped TOML,
# tokenizer and data. Extra arguments go to torchtitan, e.g. --parallelism.context_parallel_degree 4.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
NPROC=${NPROC:-2}
# the last rank's log: it holds the last pipeline stage, whose logged loss is the job's (torchtitan logs
# -2.0 on the other stages' ranks under --parallelism.pipeline_parallel_degree > 1)
exec .venv/bin/torchrun --standalone --nproc_per_node="$NPROC" --local-ranks-filter "$((NPROC - 1))" \
    -m cp_dtensor.titan.train --job.config_file titan_configs/llama3_debug.toml "$@"
