#!/usr/bin/env bash
# The documentation command: set up .venv/ (scripts/setup.sh: create or reuse), add the docs tools (the
# `docs` extra, exact versions from requirements/dev.txt; installed here only, so the test setup stays
# lean), then build the site (mkdocs.yml: docs/ + README.md as the home page + the API reference from the
# docstrings) into site/ with warnings as errors. Extra arguments go to `mkdocs build`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
stamp=.venv/.cp_dtensor-docs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/dev.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/dev.txt -e '.[docs]'
  touch "$stamp"
fi
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's notice about its successor, printed on every build
exec .venv/bin/mkdocs build --strict "$@"
