"""The model wrapper as PopTorch programs use it (issue 25, group 3, part 1).

Recompiling (after ``destroy()``, and for inputs of another shape, dtype or
structure), 0-d inputs and outputs, in-place changes to inputs, the host's
writes to weights and buffers, and custom argument parsers. Values are compared
with eager PyTorch where PopTorch agrees with it.
"""
import collections
import warnings

import pytest
import torch
import torch.nn as nn

import ipukit as poptorch
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training
from ipukit import model as wrapper_module

ICustomArgParser = getattr(poptorch, "ICustomArgParser", wrapper_module.ICustomArgParser)
registerCustomArgParser = getattr(poptorch, "registerCustomArgParser",
                                  wrapper_module.registerCustomArgParser)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        out = self.fc(x)
        if labels is None:
            return out
        return out, nn.functional.cross_entropy(out, labels)


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _no_warnings():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx


# -- recompiling ------------------------------------------------------------------------

def test_destroy_then_call_recompiles_and_trains_like_eager():
    torch.manual_seed(0)
    model = _Net()
    ref = clone_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    tm = poptorch.trainingModel(model, optimizer=opt)
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        for step in range(4):
            x, y = _data(6, seed=step)
            if step == 2:
                tm.destroy()
                assert not tm.isCompiled()
            ctx = _no_warnings()  # a recompile after destroy() is asked for: no warning
            try:
                _, loss = tm(x, y)
            finally:
                ctx.__exit__(None, None, None)
            ref_opt.zero_grad()
            _, ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    finally:
        pre.remove()
        post.remove()
    assert calls == ["pre", "post", "pre", "post"]  # the compile hooks ran again
    assert max_weight_diff(model, ref) < 1e-6      # momentum kept across the recompile
    assert tm.isCompiled() and tm.isAttachedToDevice()


def test_compile_after_destroy_compiles_again():
    model = poptorch.inferenceModel(_Net())
    x, _ = _data(2)
    model.compile(x)
    model.destroy()
    model.compile(x)
    assert model.isCompiled()
    assert torch.allclose(model(x), model.model(x), atol=1e-6)


def _recompiles(call, match):
    with pytest.warns(UserWarning, match=match):
        return call()


def test_a_shape_change_recompiles_with_a_warning_and_keeps_training_state():
    torch.manual_seed(0)
    model = _Net()
    ref = clone_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    tm = poptorch.trainingModel(model, optimizer=opt)
    for n, seed in ((4, 0), (6, 1), (6, 2), (4, 3)):
        x, y = _data(n, seed)
        if seed in (1, 3):
            _, loss = _recompiles(lambda: tm(x, y), r"recompiled the model for new inputs: "
                                                    rf"Shape mismatch for x: expected torch.Size"
                                                    rf"\(\[{10 - n}, 4\]\) but got torch.Size"
                                                    rf"\(\[{n}, 4\]\)")
        else:
            _, loss = tm(x, y)
        ref_opt.zero_grad()
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-5)
    assert max_weight_diff(model, ref) < 1e-5


def test_dtype_none_and_dict_changes_recompile_and_match_eager():
    class Model(nn.Module):
        def forward(self, x, y=None, batch=None):
            out = x * 2
            if y is not None:
                out = out + y
            if batch is not None:
                for key, value in batch.items():
                    out = out + value * len(key)
            return out

    model = Model()
    im = poptorch.inferenceModel(model)
    x = torch.ones(2, 3)
    assert torch.equal(im(x), model(x))
    xi = torch.ones(2, 3, dtype=torch.int32)
    out = _recompiles(lambda: im(xi), r"Data type mismatch for x: expected torch.float32 but "
                                      r"got torch.int32")
    assert out.dtype == torch.int32 and torch.equal(out, model(xi))
    y = torch.full((2, 3), 5.0)
    out = _recompiles(lambda: im(x, y), "Number of positional arguments mismatch: expected 1 "
                                        "arguments but got 2")
    assert torch.equal(out, model(x, y))
    out = _recompiles(lambda: im(x, None), "Type mismatch for y: expected torch.Tensor but got "
                                           "None")
    assert torch.equal(out, model(x, None))
    batch = {"a": torch.ones(2, 3)}
    out = _recompiles(lambda: im(x, None, batch), "Number of positional arguments")
    assert torch.equal(out, model(x, None, batch))
    batch2 = {"a": torch.ones(2, 3), "bb": torch.ones(2, 3)}
    out = _recompiles(lambda: im(x, None, batch2), "Keys mismatch for batch: Unexpected "
                                                   "arguments: bb")
    assert torch.equal(out, model(x, None, batch2))
    ordered = collections.OrderedDict(batch2)
    out = _recompiles(lambda: im(x, None, ordered), "Type mismatch for batch: expected dict "
                                                    "but got OrderedDict")
    assert torch.equal(out, model(x, None, ordered))
    # the same inputs again: no recompile
    ctx = _no_warnings()
    try:
        assert torch.equal(im(x, None, ordered), model(x, None, ordered))
    finally:
        ctx.__exit__(None, None, None)


def test_a_changed_python_value_recompiles():
    class Scale(nn.Module):
        def forward(self, x, u=5):
            return x * u

    im = poptorch.inferenceModel(Scale())
    x = torch.ones(2)
    assert im(x, u=5).tolist() == [5.0, 5.0]
    out = _recompiles(lambda: im(x, u=3), "Value mismatch for u: expected 5 but got 3")
    assert out.tolist() == [3.0, 3.0]


def test_keyword_arguments_in_another_order_do_not_recompile():
    model = _Net()
    tm = poptorch.trainingModel(model)
    x, y = _data(4)
    tm(x=x, labels=y)
    ctx = _no_warnings()
    try:
        tm(labels=y, x=x)
    finally:
        ctx.__exit__(None, None, None)


def test_what_stays_an_error_recompiles_nothing():
    calls = []
    handle = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    try:
        opts = poptorch.Options().deviceIterations(2)
        im = poptorch.inferenceModel(_Net(), opts)
        x, _ = _data(4)
        im(x)
        program = im.program
        with pytest.raises(poptorch.Error, match=r"Invalid batch dimension.*\(5\) must be a "
                                                 r"multiple of.*= 2"):
            im(torch.randn(5, 4))
        with pytest.raises(poptorch.Error, match="is a 0-d tensor, but each call consumes 2"):
            im(torch.tensor(1.0))
        assert im.program is program and calls == ["pre"]
    finally:
        handle.remove()


def test_a_failed_recompile_keeps_the_previous_program():
    class Picky(nn.Module):
        def forward(self, x):
            if x.shape[1] == 5:
                raise ValueError("five columns are not supported")
            return x + 1

    im = poptorch.inferenceModel(Picky())
    im(torch.ones(2, 3))
    program = im.program
    with pytest.raises(ValueError, match="five columns"):
        im(torch.ones(2, 5))
    assert im.program is program
    assert torch.equal(im(torch.ones(2, 3)), torch.full((2, 3), 2.0))


# -- 0-d tensors ------------------------------------------------------------------------

def test_a_0d_input_gives_a_0d_output():
    class Square(nn.Module):
        def forward(self, x):
            return x * x, x.sum(), (x + 1, 3), [torch.tensor(2.0), x.mean()]

    im = poptorch.inferenceModel(Square())
    out = im(torch.tensor(3.0))
    assert out[0].shape == () and out[0].item() == 9.0
    assert out[1].shape == () and out[2][0].shape == () and out[2][1] == 3
    assert [t.shape for t in out[3]] == [(), ()] and out[3][0].item() == 2.0


def test_reductions_keep_poptorchs_output_shapes():
    class Sum(nn.Module):
        def forward(self, x):
            return x.sum()

    assert poptorch.inferenceModel(Sum())(torch.ones(2, 3)).shape == ()
    # All with 2 device iterations returns one value per micro-batch
    opts = poptorch.Options().deviceIterations(2)
    assert poptorch.inferenceModel(Sum(), opts)(torch.ones(4, 3)).tolist() == [6.0, 6.0]


class _Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(x).sum()


@pytest.mark.parametrize("mode, period, di, replicas, shape", [
    ("Final", 1, 1, 1, ()), ("Final", 1, 2, 1, ()), ("Sum", 1, 2, 1, ()),
    ("All", 1, 1, 1, ()), ("All", 1, 2, 1, (2,)), ("EveryN", 2, 2, 1, ()),
    ("EveryN", 1, 2, 1, (2,)), ("Final", 1, 1, 2, (2,)), ("All", 1, 2, 2, (4,)),
])
def test_a_0d_loss_per_output_mode(mode, period, di, replicas, shape):
    # PopTorch: an output is batched by the number of values a call returns (All: DI × GA
    # × R, EveryN: that / N, Final and Sum: R); one value keeps the 0-d shape
    opts = poptorch.Options().deviceIterations(di).replicationFactor(replicas)
    if mode == "EveryN":
        opts.outputMode(poptorch.OutputMode.EveryN, period)
    else:
        opts.outputMode(getattr(poptorch.OutputMode, mode))
    tm = poptorch.trainingModel(_Loss(), opts)
    assert tuple(tm(torch.ones(2 * di * replicas, 3)).shape) == shape


# -- inputs changed in place ------------------------------------------------------------

class _AddOne(nn.Module):
    def forward(self, x):
        x += 1


def test_an_input_changed_in_place_is_changed_for_the_caller():
    model = poptorch.inferenceModel(_AddOne())
    tensor_in = torch.tensor([1.0])
    assert model(tensor_in) is None
    assert tensor_in.tolist() == [2.0]
    assert model(tensor_in) is None
    assert tensor_in.tolist() == [3.0]
    assert model(torch.tensor([1.0])) is None
    assert tensor_in.tolist() == [3.0]


def test_compiling_does_not_change_an_input():
    model = poptorch.inferenceModel(_AddOne())
    x = torch.tensor([1.0])
    model.compile(x)
    assert x.tolist() == [1.0]


def _eager_and_ipukit(forward, *inputs, opts=None):
    class Model(nn.Module):
        pass

    Model.forward = lambda self, *a: forward(*a)
    cpu = [t.clone() for t in inputs]
    ipu = [t.clone() for t in inputs]
    expected = Model()(*cpu)
    got = poptorch.inferenceModel(Model(), opts)(*ipu)
    return expected, got, cpu, ipu


@pytest.mark.parametrize("name, forward", [
    ("fill", lambda x: (x.sum(), x.fill_(1.0), x.add_(2.0))[0]),
    ("zero", lambda x: (x.zero_(), x + 1)[1]),
    ("setitem", lambda x: (x.__setitem__((slice(0, 1),), 7.0), x * 2)[1]),
    ("masked_fill", lambda x: x.masked_fill_(x > 0.5, 1.0) * 3),
    ("mul_twice", lambda x: (x.mul_(2), x.mul_(3), x - 1)[2]),
])
def test_in_place_ops_on_inputs_match_eager(name, forward):
    t = torch.rand(4, 3)
    expected, got, cpu, ipu = _eager_and_ipukit(forward, t)
    assert torch.allclose(got, expected), name
    assert torch.allclose(ipu[0], cpu[0]), name


def test_in_place_inputs_with_several_micro_batches():
    opts = poptorch.Options().deviceIterations(2)
    expected, got, cpu, ipu = _eager_and_ipukit(lambda x, y: (x.add_(y), x * 2)[1],
                                                torch.rand(4, 3), torch.rand(4, 3), opts=opts)
    assert torch.allclose(got, expected) and torch.allclose(ipu[0], cpu[0])
    assert torch.equal(ipu[1], cpu[1])  # an input only read stays as it was


def test_for_loop_bodies_take_inputs_by_value():
    # PopTorch's loop test: x += 1 in forward is seen by the caller, y += 1 in the body not
    class Model(nn.Module):
        def forward(self, x):
            x += 1

            def body(y):
                y += 1
                return y

            z = poptorch.for_loop(3, body, [x])[0]
            x += 1
            return z

    x = torch.ones(1, 5, dtype=torch.int32)
    out = poptorch.inferenceModel(Model())(x)
    assert torch.equal(x, torch.full((1, 5), 3, dtype=torch.int32))
    assert torch.equal(out, torch.full((1, 5), 5, dtype=torch.int32))


def test_a_training_model_that_changes_its_input_in_place():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x).sum()

    torch.manual_seed(0)
    model = Model()
    ref = clone_model(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.rand(4, 3)
    x_ref = x.clone()
    tm(x)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for half in (x_ref[:2], x_ref[2:]):
        (ref(half) / 2).backward()
    ref_opt.step()
    assert torch.allclose(x, x_ref)  # each micro-batch doubled once, in the caller's tensor
    assert max_weight_diff(model, ref) < 1e-6


def test_a_pipelined_model_that_changes_its_input_in_place():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            with poptorch.Block("one", ipu_id=0):
                x.mul_(2)
                h = torch.tanh(self.a(x))
            with poptorch.Block("two", ipu_id=1):
                return self.b(h).sum()

    torch.manual_seed(0)
    model = Two()
    ref = clone_model(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.rand(6, 3)
    x_ref = x.clone()
    tm(x)
    assert tm.program.partition.num_stages == 2
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        (ref(x_ref[2 * k:2 * k + 2]) / 3).backward()
    ref_opt.step()
    assert torch.allclose(x, x_ref)
    assert max_weight_diff(model, ref) < 1e-6


# -- the host's writes to weights -----------------------------------------------------------

def test_host_writes_to_weights_are_used_by_the_next_call():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 1])
    ref = clone_model(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    im = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x, y = make_data(6)
    tm(x, y)
    # reading them after training gives the trained values
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=1, gradient_accumulation=3, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6
    eval_x = x[:2]
    with torch.no_grad():
        assert torch.allclose(im(eval_x), model(eval_x), atol=1e-6)
    # an in-place write
    with torch.no_grad():
        model.head.bias.fill_(3.0)
    assert torch.allclose(im(eval_x), model(eval_x), atol=1e-6)
    # load_state_dict on the user's module
    other = StackNet(2, ipus=[0, 1])
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.allclose(im(eval_x), other(eval_x), atol=1e-6)
    # rebinding .data
    model.head.weight.data = torch.zeros_like(model.head.weight)
    with torch.no_grad():
        expected = model(eval_x)
    assert torch.allclose(im(eval_x), expected, atol=1e-6)
    assert torch.allclose(expected - model.head.bias, torch.zeros(2, 4), atol=1e-6)
    # and training goes on from there
    before = clone_model(model)
    tm(x, y)
    assert max_weight_diff(model, before) > 0


def test_a_parameter_replaced_on_the_host_is_an_error_until_copied_to_the_device():
    model = _Net()
    im = poptorch.inferenceModel(model)
    x, _ = _data(2)
    im(x)
    compiled = model.fc.weight
    model.fc.weight = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(poptorch.Error, match=r"^Parameter fc.weight is reassigned within the "
                                             r"model after it was compiled.*copyWeightsToDevice"):
        im(x)
    im.copyWeightsToDevice()
    assert model.fc.weight is compiled and torch.equal(compiled, torch.zeros(3, 4))
    assert torch.allclose(im(x), model.fc.bias.expand(2, 3))


# -- buffers ------------------------------------------------------------------------------

class _Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buffer_1", torch.ones(1))
        self.register_buffer("buffer_2", torch.ones(1))

    def forward(self, x):
        return torch.sum(x + self.buffer_1 + self.buffer_2)


def test_copy_named_buffers_to_device():
    model = _Buffers()
    opts = poptorch.Options()
    opts.updatableNamedBuffers(["buffer_1"])
    im = poptorch.inferenceModel(model, opts)
    x = torch.ones(3)
    assert im(x) == 9
    im.buffer_1.copy_(im.buffer_1 + 1)  # in place: shared with the compiled model
    im.copyNamedBuffersToDevice()
    assert im(x) == 12
    # a buffer replaced by another tensor: an error until its values are copied in
    compiled = model.buffer_1
    model.buffer_1 = torch.full([1], 4.0)
    with pytest.raises(poptorch.Error, match=r"^Buffer buffer_1 is reassigned within the model"
                                             r".*copyNamedBuffersToDevice"):
        im(x)
    im.copyNamedBuffersToDevice()
    assert model.buffer_1 is compiled and im(x) == 18


def test_copy_named_buffers_to_device_before_compiling_and_with_unknown_names():
    im = poptorch.inferenceModel(_Buffers())
    with pytest.raises(poptorch.Error, match="^Model has not been compiled or has been destroyed"):
        im.copyNamedBuffersToDevice()
    opts = poptorch.Options()
    opts.updatableNamedBuffers(["non_existing_buffer"])
    with pytest.raises(poptorch.Error, match="non_existing_buffer"):
        poptorch.inferenceModel(_Buffers(), opts)(torch.ones(3))


def test_a_buffer_redefined_in_forward_is_poptorchs_error():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            x = x + 1
            self.y = x
            return x * 2

    model = Model()
    y = model.y
    im = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match=r"^Buffer y is reassigned within the model when "
                                             r"calling the forward method\. This is not "
                                             r"supported\. Consider using self\.y\.copy_\(src\)"):
        im(torch.tensor([5.0]))
    assert model.y is y and model.y.tolist() == [2.0]


def test_a_buffer_removed_in_forward_is_poptorchs_error():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            x = x + 1
            if "y" in dict(self.named_buffers()):
                del self.y
            return x

    model = Model()
    y = model.y
    im = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match=r"^Buffer y is removed from the model when "
                                             r"calling the forward method\."):
        im(torch.tensor([5.0]))
    assert model.y is y and "y" in model.state_dict()  # back, and persistent as it was


def test_a_buffer_removed_on_the_host_after_compiling_is_an_error():
    model = _Buffers()
    im = poptorch.inferenceModel(model)
    im(torch.ones(3))
    del model.buffer_2
    model.register_buffer("other", torch.zeros(1))  # any registration: the next call looks
    with pytest.raises(poptorch.Error, match=r"^Buffer buffer_2 is removed from the model"):
        im(torch.ones(3))


def test_buffers_changed_in_place_by_forward_are_kept():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count += 1
            return x + self.count

    model = Counter()
    im = poptorch.inferenceModel(model)
    assert im(torch.zeros(1)).item() == 1 and im(torch.zeros(1)).item() == 2
    assert model.count.item() == 2


# -- custom argument parsers ----------------------------------------------------------------

class _Batch:
    def __init__(self, features, labels, scale):
        self.features, self.labels, self.scale = features, labels, scale


class _BatchParser(ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.features
        yield struct.labels

    def reconstruct(self, original_structure, tensor_iterator):
        return _Batch(next(tensor_iterator), next(tensor_iterator), original_structure.scale)


class _UsesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.seen = []

    def forward(self, batch):
        self.seen.append((type(batch).__name__, tuple(batch.features.shape)))
        out = self.fc(batch.features) * batch.scale
        return out, nn.functional.cross_entropy(out, batch.labels)


@pytest.fixture
def batch_parser():
    registerCustomArgParser(_Batch, _BatchParser())
    yield
    registerCustomArgParser(_Batch, None)


def test_a_custom_batch_reaches_forward_split_per_micro_batch(batch_parser):
    torch.manual_seed(0)
    model = _UsesBatch()
    ref = clone_model(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opts.outputMode(poptorch.OutputMode.All)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(4)
    model.seen.clear()
    out, losses = tm(_Batch(x, y, 2.0))
    assert model.seen and all(s == ("_Batch", (2, 4)) for s in model.seen)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_out, ref_losses = [], []
    for half in (slice(0, 2), slice(2, 4)):
        o, loss = ref(_Batch(x[half], y[half], 2.0))
        (loss / 2).backward()
        ref_out.append(o.detach())
        ref_losses.append(loss.detach())
    ref_opt.step()
    assert torch.allclose(out, torch.cat(ref_out), atol=1e-6)
    assert torch.allclose(losses, torch.stack(ref_losses), atol=1e-6)
    assert max_weight_diff(model, ref) < 1e-6
    # a custom batch of another size recompiles like any input
    x2, y2 = _data(8, seed=1)
    with pytest.warns(UserWarning, match=r"Shape mismatch for batch\[0\]"):
        tm(_Batch(x2, y2, 2.0))


def test_registering_a_parser_checks_its_arguments():
    before = dict(wrapper_module._CUSTOM_ARG_PARSERS)
    with pytest.raises(poptorch.Error, match=r"arg_data_type.*must be a class"):
        registerCustomArgParser("_Batch", _BatchParser())
    with pytest.raises(poptorch.Error, match=r"^arg_parser must inherit from ICustomArgParser"):
        registerCustomArgParser(_Batch, object())
    with pytest.raises(poptorch.Error, match="arg_data_type is a tensor, built-in or container"):
        registerCustomArgParser(tuple, _BatchParser())
    with pytest.raises(ValueError):  # PopTorch raised these as errors too
        registerCustomArgParser(dict, _BatchParser())
    assert wrapper_module._CUSTOM_ARG_PARSERS == before


def test_a_failing_parser_fails_the_call_and_changes_nothing(batch_parser):
    class Broken(ICustomArgParser):
        def yieldTensors(self, struct):
            raise KeyError("no tensors here")

        def reconstruct(self, original_structure, tensor_iterator):
            return original_structure

    registerCustomArgParser(_Batch, Broken())
    model = _UsesBatch()
    tm = poptorch.trainingModel(model)
    before = clone_model(model)
    x, y = _data(2)
    with pytest.raises(poptorch.Error, match=r"Broken registered for _Batch failed in "
                                             r"yieldTensors: KeyError"):
        tm(_Batch(x, y, 1.0))
    assert max_weight_diff(model, before) == 0 and not tm.isCompiled()
    parser = _BatchParser()
    registerCustomArgParser(_Batch, parser)  # replaced: the call works again
    assert wrapper_module._CUSTOM_ARG_PARSERS[_Batch] is parser
    tm(_Batch(x, y, 1.0))
    assert max_weight_diff(model, before) > 0
