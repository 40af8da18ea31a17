"""Process-wide registries and settings: a rejected value changes nothing, later calls work.

PopTorch validated its hooks at registration (``RuntimeError: Pre-compile hook must be
callable``); a non-callable kept in the registry would break every later compile in the
process. Each registry gets the same check here: reject, then compile and train normally.
"""
import logging

import pytest
import torch

import ipukit
from helpers import StackNet, make_data


def _train_once():
    torch.manual_seed(0)
    net = StackNet(num_blocks=2, width=8, classes=4)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(3)
    model = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(6)
    _, loss = model(x, y)
    model.destroy()
    return loss


@pytest.mark.parametrize("register, name", [(ipukit.registerPreCompileHook, "Pre-compile"),
                                            (ipukit.registerPostCompileHook, "Post-compile")])
@pytest.mark.parametrize("bad", [1, None, "hook"])
def test_non_callable_hook_is_refused_and_later_compiles_work(register, name, bad):
    with pytest.raises(RuntimeError, match=f"^{name} hook must be callable") as info:
        register(bad)
    assert isinstance(info.value, ipukit.Error)
    assert torch.isfinite(_train_once()).all()


def test_valid_hooks_run_and_remove():
    calls = []
    pre = ipukit.registerPreCompileHook(lambda: calls.append("pre"))
    post = ipukit.registerPostCompileHook(lambda: calls.append("post"))
    try:
        _train_once()
        assert calls == ["pre", "post"]
    finally:
        pre.remove()
        post.remove()
    _train_once()
    assert calls == ["pre", "post"]


def test_a_hook_that_raises_fails_that_compile_only():
    def broken():
        raise KeyError("from the hook")

    handle = ipukit.registerPreCompileHook(broken)
    try:
        with pytest.raises(KeyError, match="from the hook"):
            _train_once()
    finally:
        handle.remove()
    assert torch.isfinite(_train_once()).all()


@pytest.mark.parametrize("bad, match", [(5, "^Invalid log level integer"),
                                        ("wibble", "^Unknown log level: wibble. Valid values "
                                                   "are DEBUG, ERR, INFO, OFF, TRACE and WARN"),
                                        (None, "^Unknown log level"),
                                        ([1], "^Unknown log level")])
def test_bad_log_level_leaves_the_logger_as_it_was(bad, match):
    logger = logging.getLogger("ipukit")
    before = logger.level
    ipukit.setLogLevel("ERR")
    try:
        with pytest.raises(ValueError, match=match) as info:
            ipukit.setLogLevel(bad)
        assert isinstance(info.value, ipukit.Error)
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


def test_block_recorder_is_cleared_after_a_failed_trace():
    from ipukit.core.blocks import _recorder  # the registry under test

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x):
            with ipukit.Block("a", ipu_id=0):
                x = self.a(x)
            raise ValueError("fails while tracing")

    with pytest.raises(Exception):
        ipukit.inferenceModel(Broken())(torch.ones(2, 4))
    assert _recorder.get() is None
    assert torch.isfinite(_train_once()).all()
