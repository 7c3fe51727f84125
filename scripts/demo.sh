#!/usr/bin/env bash
# The README's main command: set up, then run the local self-healing demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/unicron demo "$@"
