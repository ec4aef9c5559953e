#!/usr/bin/env bash
# Create or reuse .venv/ at the repo root and install cp_dtensor (editable) with its pinned stack.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.cp_dtensor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
  touch "$stamp"
fi
