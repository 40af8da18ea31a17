#!/usr/bin/env bash
# Set up the environment and run the whole test suite: unit tests, notebooks (nbval),
# and the JupyterLab-in-Chromium browser tests.
#   ./test.sh                 everything
#   ./test.sh -m "not browser" any extra pytest arguments are passed through
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
# The browser tests drive Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt-get) for the browser tests..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium: browser tests will be skipped"
fi
# Real MNIST: the shared copy beside the checkout unless IPUKIT_DATA says otherwise.
if [ -z "${IPUKIT_DATA:-}" ] && [ -d ../shared/data/MNIST/raw ]; then
  export IPUKIT_DATA="$(cd ../shared/data && pwd)"
fi
export IPUKIT_QUICK=${IPUKIT_QUICK:-1}
exec .venv/bin/python -m pytest tests notebooks --nbval-lax -p no:cacheprovider "$@"
