"""A stage as one flat graph (ipukit/flat.py): the same ops on the same tensors.

Every runtime runs each stage's traced module inlined into one GraphModule
(the partition holds it). These tests hold it to the nested module it was made from:
the same outputs, the same gradients on the same parameter objects, the
same in-place buffer updates; and where it cannot inline, the nested module.
tests/test_distributed.py checks whole runs on processes against threads.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit
from ipukit.compile.flat import flat_stage, nested_of


class Net(nn.Module):
    """Two Blocks: nested modules, a BatchNorm (buffers updated in place), a skip, the loss."""

    def __init__(self):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.back = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x, labels):
        with ipukit.Block("a", ipu_id=0):
            h = self.front(x)
        with ipukit.Block("b", ipu_id=1):
            out = self.back(h) + h[:, :3]
            loss = F.cross_entropy(out, labels)
        return out, loss


def stages_of(net):
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    opts = ipukit.Options().recordTimeline(False)
    opts.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    return [nested_of(st.module) for st in model.program.partition.stages], x, y


def test_a_flat_stage_computes_the_same_on_the_same_tensors():
    torch.manual_seed(1)
    net = Net()
    nested, x, y = stages_of(net)
    assert all(m is not None and type(m).__name__ != "FlatStage" for m in nested)
    flat = [flat_stage(m) for m in nested]
    for f, m in zip(flat, nested):
        assert type(f).__name__ == "FlatStage" and nested_of(f) is m
        # the very parameter and buffer objects, not copies
        assert [id(p) for p in f.parameters()] == [id(p) for p in m.parameters()]
        assert {id(b) for b in f.buffers()} == {id(b) for b in m.buffers()}
        # one level: no nested modules left to call
        assert not any(hasattr(sub, "graph") for sub in f.children())
    bn = net.front[1]

    def run(stages):
        for p in net.parameters():
            p.grad = None
        before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
        h = stages[0](x)
        out, loss = stages[1](h, y)
        loss.backward()
        after = (bn.running_mean.clone(), bn.running_var.clone(),
                 int(bn.num_batches_tracked) - before[2])
        # put the buffers back: both variants start from the same state
        bn.running_mean.copy_(before[0]), bn.running_var.copy_(before[1])
        bn.num_batches_tracked.fill_(before[2])
        return out.detach(), loss.detach(), [p.grad.clone() for p in net.parameters()], after

    want, got = run(nested), run(flat)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2]))
    assert torch.equal(want[3][0], got[3][0]) and torch.equal(want[3][1], got[3][1])
    assert not torch.equal(want[3][0], bn.running_mean)  # the forward did move them
    assert want[3][2] == got[3][2] == 1  # the in-place buffer updates ran once, in both


def test_what_it_cannot_inline_stays_nested():
    plain = nn.Linear(2, 2)
    assert flat_stage(plain) is plain  # not a graph at all

    class Leaf(nn.Module):
        def forward(self, x):
            return x + 1

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    gm.add_submodule("leaf", Leaf())  # a call to a module that is not a graph
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        leaf = gm.graph.call_module("leaf", (out.args[0],))
    out.args = (leaf,)
    gm.recompile()
    assert flat_stage(gm) is gm


def test_the_flat_graph_calls_torchs_public_functions_where_they_are_the_same_op():
    """aten's overloads cost about 1 µs more a call than torch's own built-ins: the flat graph
    calls the built-in of the same name where one takes a tensor first, as a function or as a
    tensor method, and keeps the overload elsewhere; test_a_flat_stage_computes_the_same_...
    holds it to the nested module's overloads bit for bit."""
    from ipukit.compile.flat import public_op

    aten = torch.ops.aten
    assert public_op(aten.linear.default) == ("call_function", F.linear)
    assert public_op(aten.relu.default) == ("call_function", torch.relu)  # not F.relu (Python)
    assert public_op(aten.view.default) == ("call_method", "view")  # a method only
    assert public_op(aten.cat.default) == ("call_function", torch.cat)  # a list of tensors
    assert public_op(aten.zeros.default) is None  # a factory: the device mode would change it
    assert public_op(aten._to_copy.default) is None  # private: no public built-in
    assert public_op(torch.ops.pippy._pipe_split.default) is None  # not aten
    assert public_op(F.linear) is None  # already a function
    torch.manual_seed(1)
    nested, _, _ = stages_of(Net())
    for m in nested:
        flat = flat_stage(m)
        calls = [n for n in flat.graph.nodes if n.op in ("call_function", "call_method")]
        kept = [n.target for n in calls if isinstance(n.target, torch._ops.OpOverload)]
        assert all(public_op(t) is None for t in kept)
        assert F.linear in [n.target for n in calls]  # each stage's Linear went public


class ManyOps(nn.Module):
    """Two Blocks using the ops a vision or sequence model's stage holds: convolution, batch
    and layer norm, pooling, attention, GELU, softmax, embedding, reshapes, concatenation."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.embed = nn.Embedding(10, 16)
        self.proj = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16 + 4, 3)

    def forward(self, x, tokens, labels):
        with ipukit.Block("a", ipu_id=0):
            h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)       # (8, 4, 3, 3)
            pooled = h.flatten(1).view(8, 4, 9).mean(dim=2)           # (8, 4)
            e = self.embed(tokens)                                    # (8, 5, 16)
        with ipukit.Block("b", ipu_id=1):
            q, k, v = self.proj(e).chunk(3, dim=-1)
            a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1),
                                               v.unsqueeze(1)).squeeze(1)
            t = self.norm(F.gelu(a + e)).transpose(1, 2).softmax(dim=-1).sum(-1)
            out = self.head(torch.cat([t, pooled], dim=1))
            loss = F.cross_entropy(out, labels) + (out ** 2).mean() * 0.1
        return out, loss


def test_public_functions_give_the_nested_modules_results_bit_for_bit_across_many_ops():
    from ipukit.compile.flat import public_op

    torch.manual_seed(2)
    net = ManyOps()
    x, tokens, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8, 5)), torch.randint(0, 3, (8,))
    opts = ipukit.Options().recordTimeline(False)
    opts.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.0))
    model(torch.cat([x] * 4), torch.cat([tokens] * 4), torch.cat([y] * 4))
    stages = model.program.partition.stages
    nested = [nested_of(st.module) for st in stages]
    flat = [flat_stage(m) for m in nested]
    went = {n.target for f in flat for n in f.graph.nodes if n.op in ("call_function", "call_method")
            and not isinstance(n.target, torch._ops.OpOverload)}
    assert len(went) >= 8   # most of these ops have a public built-in
    kept = {n.target for f in flat for n in f.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)}
    assert all(public_op(t) is None for t in kept)

    inputs = (x, tokens, y)
    partition = model.program.partition

    def run(modules):
        for p in net.parameters():
            p.grad = None
        saved = {k: v.clone() for k, v in net.state_dict().items()}
        outputs = {}
        for st, module in zip(stages, modules):
            args = []
            for ref in st.args:
                if ref.kind == "input":
                    args.append(inputs[ref.index])
                elif ref.kind == "stage":
                    v = outputs[ref.index][ref.item or 0]
                    args.append(v.detach().requires_grad_(v.is_floating_point()))
                else:
                    args.append(ref.value)
            out = module(*args)
            outputs[st.index] = tuple(out) if st.tuple_output else (out,)
        last = outputs[stages[-1].index]
        loss = partition.outputs[partition.loss_output]
        loss = outputs[loss.index][loss.item or 0]
        loss.backward()
        got = ([t.detach() for t in last if isinstance(t, torch.Tensor)],
               [p.grad.clone() for p in net.parameters() if p.grad is not None],
               [v.clone() for v in net.state_dict().values()])
        net.load_state_dict(saved)   # both variants start from the same buffers
        return got

    want, got = run(nested), run(flat)
    for a, b in zip(want, got):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    assert len(want[1]) >= 6   # the second stage's gradients only (its inputs are detached)
