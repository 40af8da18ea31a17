"""Faults and bad input: a clear ipukit error, unchanged state, and no worker left running.

The cases come from a probe of 104 faults and bad inputs run against tiny
models; each test here failed (wrong training, a hang, a raw traceback, or
changed state) before the fix it covers.
"""
import _thread
import copy
import pickle
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn

import ipukit
from helpers import (StackNet, clone_model, ipukit_threads, make_data, max_weight_diff,
                     reference_training)


class BNStack(nn.Module):
    """Two blocks with BatchNorm (buffers that a late worker would change)."""

    def __init__(self, width=8):
        super().__init__()
        self.a, self.bn = nn.Linear(width, width), nn.BatchNorm1d(width)
        self.b = nn.Linear(width, 4)

    def forward(self, x, y):
        with ipukit.Block("B0", ipu_id=0):
            x = torch.tanh(self.bn(self.a(x)))
        with ipukit.Block("B1", ipu_id=1):
            out = self.b(x)
            loss = nn.functional.cross_entropy(out, y)
        return out, loss


def _state(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    opt = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
           for s in optimizer.state.values()]
    return params, buffers, opt


def _assert_unchanged(model, optimizer, saved):
    params, buffers, opt = saved
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    for b, c in zip(model.buffers(), buffers):
        assert torch.equal(b, c)
    live = list(optimizer.state.values())
    assert len(live) == len(opt)
    for s, t in zip(live, opt):
        assert s.keys() == t.keys()
        for k in s:
            assert torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k]))
    assert all(p.grad is None for p in model.parameters())
    assert ipukit_threads() == []


class FailingSGD(torch.optim.SGD):
    """SGD whose ``step`` updates the weights, then raises (or sends Ctrl-C) on call ``fail_at``."""

    def __init__(self, params, **kw):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.calls, self.fail_at, self.how = 0, None, "raise"

    def step(self, closure=None):
        super().step(closure)
        self.calls += 1
        if self.calls == self.fail_at:
            if self.how == "raise":
                raise RuntimeError("optimizer failed after updating")
            _thread.interrupt_main()  # Ctrl-C during the step: raised once the step is done
            time.sleep(0.05)


def _options(di, strategy, replicas):
    opts = ipukit.Options().deviceIterations(di).replicationFactor(replicas)
    if strategy == "pipelined":
        opts.Training.gradientAccumulation(3)
    elif strategy == "sharded":
        opts.Training.gradientAccumulation(2)
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    return opts


@pytest.mark.parametrize("how", ["raise", "interrupt"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("strategy", ["single", "sharded", "pipelined"])
@pytest.mark.parametrize("di", [1, 3])
def test_a_failing_step_restores_everything(di, strategy, replicas, how):
    torch.manual_seed(0)
    model = BNStack() if strategy != "single" else StackNet(1)
    opt = FailingSGD(model.parameters())
    opts = _options(di, strategy, replicas)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    factor = opts.combined_batch_factor
    x, y = make_data(4 * factor)
    tm(x, y)  # a good call first: the optimiser has momentum state
    saved = _state(model, opt)
    opt.fail_at, opt.how = opt.calls + di, how  # the call's last step fails after updating
    with pytest.raises(KeyboardInterrupt if how == "interrupt" else RuntimeError):
        tm(x, y)
    _assert_unchanged(model, opt, saved)
    opt.fail_at = None
    tm(x, y)  # still usable
    assert not torch.equal(next(model.parameters()), saved[0][0])


def test_a_second_ctrl_c_while_stopping_leaves_no_worker_running(monkeypatch):
    """Ctrl-C twice: the call returns only after every worker ended; buffers are restored."""
    from ipukit.runtime import workers

    torch.manual_seed(0)
    model = BNStack()
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    x, y = make_data(12 * 4)
    tm(x, y)
    saved = _state(model, opt)
    puts = {"n": 0}
    original = workers.Exchange.put

    def put(self, key, value):
        original(self, key, value)
        puts["n"] += 1
        if puts["n"] == 5:  # from a worker thread, mid-call: Ctrl-C, then again 50 ms later
            _thread.interrupt_main()
            time.sleep(0.05)
            _thread.interrupt_main()

    monkeypatch.setattr(workers.Exchange, "put", put)
    with pytest.raises(KeyboardInterrupt):
        tm(x, y)
    assert ipukit_threads() == []
    time.sleep(0.1)  # nothing may change the state after the call has returned
    _assert_unchanged(model, opt, saved)


def test_interrupt_pending_during_a_deferred_section_is_raised_after_it():
    from ipukit.runtime.workers import InterruptGuard

    guard = InterruptGuard()
    done = []
    with guard:
        with pytest.raises(KeyboardInterrupt):
            with guard.deferred():
                _thread.interrupt_main()
                time.sleep(0.05)  # the handler runs here, but only remembers it
                done.append("finished")
    assert done == ["finished"]


def test_pool_join_waits_for_every_worker_and_reports_the_first_error():
    from ipukit.runtime.workers import Aborted, Pool

    stop = threading.Event()

    def target(i):
        if i == 0:
            raise ValueError("first")
        if i == 1:
            raise Aborted()
        stop.wait(0.2)
        raise RuntimeError("later")

    pool = Pool(["ipukit-ipu0-t", "ipukit-ipu1-t", "ipukit-ipu2-t"], target,
                on_error=stop.set).start()
    pool.join()
    assert pool.alive() == []
    assert isinstance(pool.error, ValueError)


# -- silent wrong training -------------------------------------------------------------------

class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 4)

    def forward(self, x, y):
        out = self.l(x)
        return {"loss": nn.functional.cross_entropy(out, y), "logits": out}


def test_a_dict_output_trains_on_its_loss_entry():
    torch.manual_seed(0)
    model = DictOut()
    ref = clone_model(model)
    tm = ipukit.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = make_data(8)
    for _ in range(3):
        out = tm(x, y)
    assert set(out) == {"loss", "logits"}
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        ref(x, y)["loss"].backward()
        opt.step()
    assert max_weight_diff(model, ref) < 1e-6


class Logits(nn.Module):
    def __init__(self, per_sample=False):
        super().__init__()
        self.l = nn.Linear(8, 4)
        self.per_sample = per_sample

    def forward(self, x, y):
        out = self.l(x)
        if self.per_sample:
            return out, nn.functional.cross_entropy(out, y, reduction="none")
        return out


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_non_scalar_loss_is_an_error_not_silent_training(per_sample):
    model = Logits(per_sample)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tm = ipukit.trainingModel(model, optimizer=opt)
    saved = _state(model, opt)
    with pytest.raises(ipukit.Error, match="not a scalar"):
        tm(*make_data(8))
    _assert_unchanged(model, opt, saved)


def test_identity_loss_with_reduction_none_still_trains():
    class Marked(Logits):
        def forward(self, x, y):
            out = self.l(x)
            return out, ipukit.identity_loss(nn.functional.cross_entropy(out, y,
                                                                         reduction="none"),
                                             reduction="none")

    model = Marked()
    before = clone_model(model)
    ipukit.trainingModel(model)(*make_data(8))
    assert max_weight_diff(model, before) > 0


def test_an_optimizer_over_another_module_is_refused():
    other = StackNet(1)
    with pytest.raises(ipukit.Error, match="updates none of"):
        ipukit.trainingModel(StackNet(1), optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_an_optimizer_given_as_a_string_is_refused_at_wrap_time():
    with pytest.raises(ipukit.Error, match="expected a torch.optim.Optimizer"):
        ipukit.trainingModel(StackNet(1), optimizer="adam")


def test_an_empty_first_batch_is_refused_and_leaves_the_model_uncompiled():
    tm = ipukit.trainingModel(StackNet(1))
    x, y = make_data(4)
    with pytest.raises(ipukit.Error, match="holds no samples"):
        tm(x[:0], y[:0])
    assert not tm.isCompiled()
    tm(x, y)


def test_a_dataset_smaller_than_one_combined_batch_warns():
    opts = ipukit.Options().deviceIterations(4)
    with pytest.warns(UserWarning, match="no batch at all"):
        loader = ipukit.DataLoader(opts, torch.utils.data.TensorDataset(*make_data(6)),
                                   batch_size=2)
    assert len(loader) == 0


def test_a_loader_built_for_other_options_warns_at_the_model():
    loader = ipukit.DataLoader(ipukit.Options().deviceIterations(2),
                               torch.utils.data.TensorDataset(*make_data(8)), batch_size=2)
    tm = ipukit.trainingModel(StackNet(1), ipukit.Options().deviceIterations(4))
    x, y = next(iter(loader))
    with pytest.warns(UserWarning, match="built for Options with 2 micro-batches per call"):
        tm(x, y)
    tm2 = ipukit.trainingModel(StackNet(1), ipukit.Options().deviceIterations(4))
    right = ipukit.DataLoader(tm2.options, torch.utils.data.TensorDataset(*make_data(16)),
                              batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in right:
            tm2(x, y)


def test_a_destroyed_training_model_recompiles_unless_its_module_was_wrapped_again():
    # PopTorch: a call after destroy() compiles again; ipukit also wraps the module again
    model = StackNet(1)
    tm = ipukit.trainingModel(model)
    x, y = make_data(4)
    tm(x, y)
    tm.destroy()
    before = clone_model(model)
    tm(x, y)
    assert tm.isCompiled() and max_weight_diff(model, before) > 0
    with pytest.raises(ipukit.Error, match="already been wrapped"):
        ipukit.trainingModel(model)
    tm.destroy()
    other = ipukit.trainingModel(model)  # the module can be wrapped again
    other(x, y)
    before = clone_model(model)
    with pytest.raises(ipukit.Error, match="already been wrapped.*another training model"):
        tm(x, y)  # two training wrappers of one module never both train
    assert max_weight_diff(model, before) == 0 and not tm.isCompiled()


# -- raw tracebacks that became ipukit errors -----------------------------------------------

def test_a_batching_option_assigned_directly_is_checked():
    opts = ipukit.Options()
    opts.device_iterations = -2
    with pytest.raises(ipukit.Error, match="deviceIterations is -2"):
        ipukit.trainingModel(StackNet(1), opts)(*make_data(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_mapping_to_cuda_without_cuda():
    opts = ipukit.Options().deviceMapping(["cuda:0"])
    with pytest.raises(ipukit.Error, match="cuda:0 is not available"):
        ipukit.trainingModel(StackNet(1), opts)(*make_data(4))


def test_a_model_without_parameters_cannot_train():
    class NoParams(nn.Module):
        def forward(self, x, y):
            return x, (x - 1).pow(2).mean()

    with pytest.raises(ipukit.Error, match="no trainable parameters"):
        ipukit.trainingModel(NoParams())(*make_data(4))


def test_integer_data_into_float_layers_is_cast_to_the_weights_type_as_in_poptorch():
    """PopTorch resolved integer activations meeting float weights by casting them (its
    type rules; ipukit.compile.partition.MixedPrecision): no dtype error, eager's values."""
    x, _ = make_data(4)
    torch.manual_seed(0)
    net = StackNet(1)
    out = ipukit.inferenceModel(net)(x.long())
    assert out.dtype == torch.float32
    assert torch.allclose(out, net(x.long().float()), atol=1e-6)


@pytest.mark.parametrize("blocks", [1, 2])
def test_double_inputs_run_as_float32_as_in_poptorch(blocks):
    torch.manual_seed(0)
    model = StackNet(blocks)
    ref = clone_model(model)
    ga = 1 if blocks == 1 else 3
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(ga)
    x, y = make_data(4 * ga)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = tm(x.double(), y)
    assert out.dtype == torch.float32
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=1, gradient_accumulation=ga, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6


def test_meta_inputs_are_refused():
    x, y = make_data(4)
    with pytest.raises(ipukit.Error, match="meta device"):
        ipukit.trainingModel(StackNet(1))(x.to("meta"), y)


def test_a_dataloader_mode_that_does_not_exist():
    with pytest.raises(ipukit.Error, match="mode='fast'"):
        ipukit.DataLoader(ipukit.Options(), torch.utils.data.TensorDataset(*make_data(4)),
                          mode="fast")


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_a_wrapper_cannot_be_copied_or_saved_but_says_what_to_do(how, tmp_path):
    tm = ipukit.trainingModel(StackNet(1))
    tm(*make_data(4))
    do = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
          "torch.save": lambda m: torch.save(m, tmp_path / "m.pt")}[how]
    with pytest.raises(ipukit.UnsupportedError, match="state_dict"):
        do(tm)


# -- is this running on a (virtual) IPU? ---------------------------------------------------

class Probe(nn.Module):
    seen: list = []

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks
        self.l = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))

    def forward(self, x, y):
        for i, layer in enumerate(self.l):
            with ipukit.Block(f"B{i}", ipu_id=i):
                if ipukit.isRunningOnIpu():
                    x = layer(x)
                else:
                    x = layer(x) * 0  # the wrong branch: weights would get no gradient
                if i == self.blocks - 1:
                    loss = nn.functional.mse_loss(x, y)
        return x, loss


@pytest.mark.parametrize("blocks,replicas", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_is_running_on_ipu_inside_every_stage_and_replica(blocks, replicas):
    torch.manual_seed(0)
    model = Probe(blocks)
    opts = ipukit.Options().replicationFactor(replicas)
    if blocks > 1:
        opts.Training.gradientAccumulation(3)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2 * opts.combined_batch_factor, 8)
    out, _ = tm(x, torch.randn_like(x))
    assert out.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert not ipukit.isRunningOnIpu()


# -- the asynchronous DataLoader ----------------------------------------------------------

def test_async_loader_left_early_then_iterated_again_does_not_hang():
    opts = ipukit.Options()
    loader = ipukit.DataLoader(opts, torch.utils.data.TensorDataset(*make_data(8)), batch_size=2,
                               mode=ipukit.DataLoaderMode.Async,
                               async_options={"buffer_size": 1})
    result = {}

    def scenario():
        for _ in loader:
            break
        time.sleep(0.2)  # the loader thread fills its one-slot buffer and waits
        result["second"] = sum(1 for _ in loader)
        loader.terminate()

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "the Async DataLoader hung"
    assert result["second"] == 4
    assert [th for th in threading.enumerate() if th.name == "ipukit-dataloader" and th.is_alive()] == []


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        with ipukit.Block("B0", ipu_id=0):
            x.mul_(2)
            h = torch.tanh(self.a(x))
        with ipukit.Block("B1", ipu_id=1):
            out = self.b(h)
            loss = nn.functional.cross_entropy(out, y)
        return out, loss


def test_an_in_place_change_to_an_input_trains_as_plain_pytorch():
    torch.manual_seed(0)
    model = InPlace()
    ref = clone_model(model)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(3)
    x, y = make_data(6)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x.clone(), y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x.clone(), y,
                       device_iterations=1, gradient_accumulation=3, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6


@pytest.mark.parametrize("burst", [2, 10, 200])
def test_a_burst_of_ctrl_c_returns_only_after_every_worker_joined(monkeypatch, burst):
    """Ctrl-C many times, 2 ms apart, from a worker mid-call: whichever part of the abort
    each one lands in (stopping, joining, restoring), the exception reaches the caller only
    after every worker has ended, and the state is the one from before the call."""
    import threading

    from ipukit.runtime import workers

    torch.manual_seed(0)
    model = BNStack()
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    x, y = make_data(12 * 4)
    tm(x, y)
    saved = _state(model, opt)
    puts = {"n": 0}
    original = workers.Exchange.put

    def put(self, key, value):
        original(self, key, value)
        puts["n"] += 1
        if puts["n"] == 5:
            for _ in range(burst):
                _thread.interrupt_main()
                time.sleep(0.002)

    monkeypatch.setattr(workers.Exchange, "put", put)
    with pytest.raises(KeyboardInterrupt):
        tm(x, y)
    assert [t.name for t in threading.enumerate() if t.name.startswith("ipukit-")] == []
    time.sleep(0.1)
    _assert_unchanged(model, opt, saved)
    monkeypatch.setattr(workers.Exchange, "put", original)
    tm(x, y)   # the next call trains normally


def test_an_error_then_ctrl_c_during_the_abort_leaves_no_worker(monkeypatch):
    """A worker fails, and Ctrl-C arrives while the others are being stopped: the worker's
    error is raised (the Ctrl-C is absorbed by the abort), after every worker joined."""
    import threading

    from ipukit.runtime import workers

    torch.manual_seed(0)
    model = BNStack()
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    x, y = make_data(12 * 4)
    tm(x, y)
    saved = _state(model, opt)
    original_fail = workers.Pool.fail
    original_put = workers.Exchange.put
    puts = {"n": 0}

    def put(self, key, value):
        original_put(self, key, value)
        puts["n"] += 1
        if puts["n"] == 5:
            raise ValueError("a worker fails")

    def fail(self, exc):
        _thread.interrupt_main()   # Ctrl-C lands while the pool is being stopped
        original_fail(self, exc)

    monkeypatch.setattr(workers.Exchange, "put", put)
    monkeypatch.setattr(workers.Pool, "fail", fail)
    with pytest.raises((ValueError, KeyboardInterrupt)):
        tm(x, y)
    assert [t.name for t in threading.enumerate() if t.name.startswith("ipukit-")] == []
    time.sleep(0.1)
    _assert_unchanged(model, opt, saved)
