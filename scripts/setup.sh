#!/usr/bin/env bash
# Idempotent setup: Debian's etcd-server, a .venv at the repo root with the pinned requirements,
# and this project installed editable (console scripts unicron, unicron-agent, unicron-coordinator).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v etcd >/dev/null 2>&1; then
  echo "setup: installing Debian's etcd-server" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi

stamp=.venv/.unicron-requirements
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned requirements into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and alone, so nothing else can pull a different (CUDA) build of it.
  .venv/bin/python -m pip install -q "$(grep '^torch==' requirements.txt)"
  .venv/bin/python -m pip install -q -r requirements.txt
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
