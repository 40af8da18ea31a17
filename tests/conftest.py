import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# the notebooks' helpers (lessons.py, debugging.py) live beside the notebooks
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "notebooks"))

DATA_ROOT = os.environ.get("IPUKIT_DATA") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def data_root():
    if not os.path.isdir(os.path.join(DATA_ROOT, "MNIST", "raw")):
        pytest.skip(f"real MNIST not found under {DATA_ROOT}/MNIST/raw (set IPUKIT_DATA)")
    if importlib.util.find_spec("torchvision") is None:   # ipukit.datasets reads it with it
        pytest.skip('MNIST is read with torchvision: pip install "ipukit[examples]"')
    return DATA_ROOT


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_marked(request, monkeypatch):
    """The suite's tests are written for CPU: on a machine with CUDA, only tests marked
    ``gpu`` see it (ipukit would otherwise place virtual IPUs on CUDA by default)."""
    if request.node.get_closest_marker("gpu") is None and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield


#: the files that take longest: they start first (./test.sh keeps this order across its
#: workers, ``--no-loadscope-reorder``), so that the workers finish together
LONGEST_FIRST = ("browser/test_notebooks_in_lab.py", "browser/test_lessons_in_lab.py",
                 "browser/test_scaling_in_lab.py", "test_notebooks_loaded.py", "test_widgets.py",
                 "test_distributed.py", "test_packaging.py", "test_script.py",
                 "test_benchmarks_smoke.py")


def _rank(item) -> int:
    path = str(item.fspath).replace(os.sep, "/")
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("/tests/" + name)),
                len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    """The longest files first (a stable sort: each file's tests keep their order).

    Tests marked ``processes`` run ipukit's process runtime, which needs a newer torch
    than its threads (``PROCESS_RUNTIME_TORCH``); tests marked ``needs("module", ...)`` an
    optional module (an extra). Where either is missing they are skipped, saying why, so
    that the suite runs as far as it can on, e.g., a GPU machine's preinstalled torch 2.11."""
    from ipukit.runtime.processes.group import PROCESS_RUNTIME_TORCH, torch_release

    items.sort(key=_rank)
    old = torch_release() < PROCESS_RUNTIME_TORCH
    wanted = ".".join(map(str, PROCESS_RUNTIME_TORCH))
    for item in items:
        if old and item.get_closest_marker("processes") is not None:
            item.add_marker(pytest.mark.skip(
                reason=f"ipukit's process runtime needs torch {wanted} or later; this is "
                       f"torch {torch.__version__}"))
        for mark in item.iter_markers("needs"):
            missing = [m for m in mark.args if importlib.util.find_spec(m) is None]
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {', '.join(missing)} (an extra: pip install "
                           f"\"ipukit[test]\")"))
