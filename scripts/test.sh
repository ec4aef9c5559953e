#!/usr/bin/env bash
# The test command: set up .venv/ (create or reuse) and run the whole suite on CPU/gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q "$@"
