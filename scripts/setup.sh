#!/usr/bin/env bash
# Create or reuse .venv/ at the repo root and install cp_dtensor (editable) with every extra, on the pinned
# dev stack: the exact versions in requirements/dev.txt (torch 2.13.0 from the machine's local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.cp_dtensor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/dev.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/dev.txt -e '.[all,test,bench]'
  touch "$stamp"
fi
