"""ipukit/_torch.py is the only home of torch's private names: each one exists here.

Run against torch 2.14.1 (Python 3.11 and 3.12, this project's constraints: the whole
suite) and torch 2.11.0 (Python 3.12, no extras: this file and the core's threaded tests,
484 passed) on 2026-11-25; the supported range is torch>=2.11,<2.15 (pyproject). The
process runtime needs 2.14 (ipukit.runtime.processes.group.PROCESS_RUNTIME_TORCH: 2.11's
schedules take no pre-split micro-batches) and says so. A torch release that moves one of
these names fails this test first, and only ipukit/_torch.py needs changing.
"""
import ast
import importlib
import pathlib

import pytest
import torch

from ipukit import _torch

TESTED_WITH = ("2.14.1", "2.11.0")


@pytest.mark.parametrize("module, name", _torch.PRIVATE_NAMES)
def test_each_private_name_exists(module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path, method", _torch.PRIVATE_METHODS)
def test_each_private_method_exists(path, method):
    module, cls = path.rsplit(".", 1)
    assert callable(getattr(getattr(importlib.import_module(module), cls), method))


def test_torch_is_in_the_supported_range():
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert (2, 11) <= (major, minor) < (2, 15)


def test_no_other_module_imports_a_private_torch_module():
    root = pathlib.Path(_torch.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        if path.name == "_torch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("torch")]
            for name in names:
                if any(part.startswith("_") and not part.startswith("__")
                       for part in name.split(".")):
                    bad.append(f"{path.relative_to(root)}: {name}")
    assert bad == []


def test_the_adapter_works():
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    assert _torch.grad_fn_or_grad_acc(y) is y.grad_fn
    assert str(_torch.torch_action("1F0")) == "1F0"
    leaves, spec = _torch.pytree.tree_flatten(((x, 1), {"a": x}))
    assert len(leaves) == 3
