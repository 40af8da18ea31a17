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
