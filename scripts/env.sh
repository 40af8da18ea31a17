# Sourced by start.sh and test.sh: create .venv (Python 3.11 unless $PYTHON names another
# interpreter, 3.11-3.13) and install ipukit with the extras given as $1, at the versions
# pinned in constraints.txt; point IPUKIT_DATA at the shared MNIST copy when present.
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$1]" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
if [ -z "${IPUKIT_DATA:-}" ] && [ -d ../shared/data/MNIST/raw ]; then
  export IPUKIT_DATA="$(cd ../shared/data && pwd)"
fi
