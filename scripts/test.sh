#!/usr/bin/env bash
# The README's test command: set up, run static checks, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff" && .venv/bin/ruff check .
echo "== import-linter" && .venv/bin/lint-imports
echo "== mypy --strict" && .venv/bin/mypy .
echo "== pytest"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
