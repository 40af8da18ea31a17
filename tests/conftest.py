import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

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
    return DATA_ROOT


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_marked(request, monkeypatch):
    """The suite's tests are written for CPU: on a machine with CUDA, only tests marked
    ``gpu`` see it (ipukit would otherwise place virtual IPUs on CUDA by default)."""
    if request.node.get_closest_marker("gpu") is None and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
