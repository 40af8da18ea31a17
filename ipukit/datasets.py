"""MNIST from a configurable data root, without surprise downloads: the ``root`` argument,
``IPUKIT_DATA``, then ``~/.torch/datasets``; torchvision reads ``<root>/MNIST/raw/`` offline
and downloads only when the files are missing. Otherwise a ``DataError`` says where it looked.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .core.errors import DataError, needs_extra

DATA_ENV = "IPUKIT_DATA"
DEFAULT_ROOT = "~/.torch/datasets"
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def data_root(root: Optional[str] = None) -> str:
    """The folder that holds (or will hold) ``MNIST/raw``."""
    chosen = root or os.environ.get(DATA_ENV) or DEFAULT_ROOT
    return os.path.abspath(os.path.expanduser(chosen))


def mnist(train: bool = True, root: Optional[str] = None, download: bool = True):
    """torchvision's MNIST with the tutorial's transform (ToTensor, Normalize)."""
    with needs_extra("examples", "ipukit.datasets.mnist"):
        import torchvision

    path = data_root(root)
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((MNIST_MEAN,), (MNIST_STD,)),
    ])
    try:
        return torchvision.datasets.MNIST(path, train=train, download=download,
                                          transform=transform)
    except Exception as exc:  # noqa: BLE001 - turned into a clear message
        raise DataError(
            f"MNIST not found under {path}/MNIST/raw and it could not be downloaded "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). "
            f"Point the data root at a folder containing MNIST/raw/ with the four IDX files: "
            f"pass root=..., or set the environment variable {DATA_ENV}=/path/to/data "
            "(with internet access, any writable folder works: the files are downloaded).") from exc


def mnist_tensors(train: bool = True, root: Optional[str] = None, limit: Optional[int] = None,
                  download: bool = True) -> torch.utils.data.TensorDataset:
    """MNIST as one normalised tensor dataset, loaded once (the samples of :func:`mnist`, faster
    to iterate); ``limit`` keeps the first ``limit`` samples.
    """
    ds = mnist(train=train, root=root, download=download)
    images = ds.data if limit is None else ds.data[:limit]
    labels = ds.targets if limit is None else ds.targets[:limit]
    x = images.unsqueeze(1).to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
    return torch.utils.data.TensorDataset(x, labels.clone())
