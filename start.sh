#!/usr/bin/env bash
# Set up the environment and open JupyterLab on the notebooks.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh notebooks
exec .venv/bin/jupyter lab --notebook-dir=notebooks "$@"
