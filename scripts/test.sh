#!/usr/bin/env bash
# The test command: set up .venv/ (create or reuse), lint (ruff, pyproject.toml) and run the whole suite on CPU/gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check cp_dtensor tests scripts
exec .venv/bin/python -m pytest tests -q "$@"
