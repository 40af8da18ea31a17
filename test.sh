#!/usr/bin/env bash
# Set up the environment and run the whole test suite: unit tests, notebooks (nbval),
# and the JupyterLab-in-Chromium browser tests.
#   ./test.sh                  everything
#   ./test.sh -m "not browser" extra pytest arguments are passed through
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh test
# The browser tests drive Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt-get) for the browser tests..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium: browser tests will be skipped"
fi
export IPUKIT_QUICK=${IPUKIT_QUICK:-1}
# Without test paths among the arguments, run everything.
paths=0
for arg in "$@"; do
  case "$arg" in tests*|notebooks*|*.py|*.py::*|*.ipynb) paths=1 ;; esac
done
if [ "$paths" = 0 ]; then
  set -- tests notebooks "$@"
fi
# Test files run side by side in IPUKIT_TEST_WORKERS processes (pytest-xdist; 0: one process),
# each file whole in one of them (notebook cells in order, the browser tests' one server),
# in the order tests/conftest.py gives them (the longest first).
workers=${IPUKIT_TEST_WORKERS:-2}
if [ "$workers" != 0 ]; then
  set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python -m pytest --nbval-lax -p no:cacheprovider "$@"
