#!/usr/bin/env bash
# Set up the environment and open JupyterLab on the notebooks.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[notebooks]' 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
if [ -z "${IPUKIT_DATA:-}" ] && [ -d ../shared/data/MNIST/raw ]; then
  export IPUKIT_DATA="$(cd ../shared/data && pwd)"
fi
exec .venv/bin/jupyter lab --notebook-dir=notebooks "$@"
