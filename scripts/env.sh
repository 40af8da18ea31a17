# Sourced by start.sh and test.sh: create .venv (Python 3.11 unless $PYTHON names another
# interpreter, 3.11-3.13) and install ipukit with the extras given as $1, at the versions
# pinned in constraints.txt; point IPUKIT_DATA at the shared MNIST copy when present.
#
# IPUKIT_USE_INSTALLED_TORCH=1 keeps the torch already installed for $PYTHON (a GPU box's,
# say) instead of installing constraints.txt's torch and CUDA wheels: .venv is made with
# --system-site-packages, that torch must lie in pyproject's torch range, and
# the install uses constraints.txt without its torch-coupled pins (torch, torchvision,
# triton, nvidia-*, cuda-*, setuptools) plus torch==<the installed version>; a torchvision
# installed alongside is kept when it goes with that torch, else pip picks one that does.
# The rule lives in scripts/torch_pins.py. An existing .venv is reused either way; one made
# without the switch has its own torch, so remove it (rm -rf .venv) before turning it on.
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
ipukit_constraints=constraints.txt
ipukit_torch="(constraints.txt's pin)"
if [ "${IPUKIT_USE_INSTALLED_TORCH:-0}" = 1 ]; then
  ipukit_constraints=$(mktemp "${TMPDIR:-/tmp}/ipukit-constraints.XXXXXX")
  # Checks the range and writes the constraints that keep this torch; prints its line.
  if ! ipukit_wanted=$("$PY" scripts/torch_pins.py installed "$ipukit_constraints"); then
    rm -f "$ipukit_constraints"
    return 1
  fi
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
  fi
  "$PY" scripts/torch_pins.py share .venv
  ipukit_seen=$(.venv/bin/python scripts/torch_pins.py where)
  if [ "$ipukit_seen" != "$ipukit_wanted" ]; then
    echo "IPUKIT_USE_INSTALLED_TORCH=1: .venv sees $ipukit_seen, not the" \
      "$ipukit_wanted installed for $PY (.venv was made without --system-site-packages," \
      "or holds a torch of its own): remove it (rm -rf .venv) and run again, or unset" \
      "IPUKIT_USE_INSTALLED_TORCH" >&2
    rm -f "$ipukit_constraints"
    return 1
  fi
  ipukit_torch="(installed for $PY, IPUKIT_USE_INSTALLED_TORCH=1)"
elif [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c "$ipukit_constraints" \
  -e ".[$1]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
[ "$ipukit_constraints" = constraints.txt ] || rm -f "$ipukit_constraints"
echo "ipukit: using $(.venv/bin/python scripts/torch_pins.py where) $ipukit_torch"
if [ -z "${IPUKIT_DATA:-}" ] && [ -d ../shared/data/MNIST/raw ]; then
  export IPUKIT_DATA="$(cd ../shared/data && pwd)"
fi
