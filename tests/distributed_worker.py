"""Run by tests/test_distributed.py under ipukit-run: one launch, several checks.

Every process runs the distributed model and, locally, the same model on
threads (``Options.Distributed.disable()``); each writes what it found to
``$IPUKIT_TEST_OUT/rank<r>.json`` for the test to assert on.
Scenarios: ``pp2`` (2 processes, also the modern schedules against threads and the plain
PyTorch loop; ends with rank 1 raising), ``dp2pp2`` (4 processes), ``memory`` (2 processes:
measured memory per virtual IPU, against threads).
"""
import copy
import json
import os
import signal
import sys
import time

import torch

import ipukit as poptorch
import ipukit.distributed as ipd
from ipukit.runtime.processes.runtime import DistributedError, _runtime_of

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


class SkipNet(torch.nn.Module):
    """Stage 0 output used by stage 1 and (a skip) by the last stage; labels in the last block."""

    def __init__(self, stages=2, batchnorm=False, ipus=None, width=8, features=6):
        super().__init__()
        self.stages = stages
        self.ipus = list(ipus) if ipus else default_placement(stages)
        self.inp = torch.nn.Linear(features, width)
        self.bn = torch.nn.BatchNorm1d(width) if batchnorm else torch.nn.Identity()
        self.mid = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(stages - 1))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x, labels):
        with poptorch.Block("b0", ipu_id=self.ipus[0]):
            h0 = torch.tanh(self.bn(self.inp(x)))
        h = h0
        for i, layer in enumerate(self.mid):
            with poptorch.Block(f"b{i + 1}", ipu_id=self.ipus[i + 1]):
                h = torch.tanh(layer(h))
                if i == len(self.mid) - 1:
                    out = self.head(h + h0)
                    loss = torch.nn.functional.cross_entropy(out, labels)
        return out, loss


def default_placement(stages):
    """Two stages: one per virtual IPU; more: in a loop over two (stage s on IPU s mod 2)."""
    return [i % 2 for i in range(stages)] if stages > 2 else list(range(stages))


def options(mode, distributed=True, di=2, ga=4, replicas=1, schedule="1F1B", stages=2,
            placement=None):
    o = poptorch.Options().deviceIterations(di).replicationFactor(replicas)
    o.Training.gradientAccumulation(ga)
    o.outputMode(mode)
    o.pipelineSchedule(schedule)
    if stages > 2 or placement:
        o.setExecutionStrategy(poptorch.PipelinedExecution(
            *[poptorch.Stage(f"b{i}").ipu(p)
              for i, p in enumerate(placement or default_placement(stages))]))
    if not distributed:
        o.Distributed.disable()
    return o


def data(calls, replicas, di=2, ga=4, micro=2, seed=0, features=6):
    g = torch.Generator().manual_seed(seed)
    n = micro * di * ga * replicas
    return [(torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g))
            for _ in range(calls)]


def share(t, replica, replicas, micro):
    """Replica ``replica``'s micro-batches of a combined batch, in the threaded executor's order."""
    chunks = t.split(micro)
    return torch.cat([c for k, c in enumerate(chunks) if k % replicas == replica])


def maxdiff(a, b):
    if isinstance(a, (tuple, list)):
        return max(maxdiff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def train_pair(mode, replicas=1, schedule="1F1B", stages=2, batchnorm=False, calls=2, ga=4,
               placement=None, plain=False, wrapper=False):
    """(distributed results, threaded results) for the same model, data and options; with
    ``plain``, also the plain PyTorch loop's weights (one replica); with ``wrapper``, the
    model is ``ipukit.distributed.trainingModel``'s and ``ipd.synchronize_weights`` syncs it."""
    torch.manual_seed(1)
    net = SkipNet(stages, batchnorm, placement)
    ref = copy.deepcopy(net)
    loop = copy.deepcopy(net) if plain else None
    init = copy.deepcopy(net) if plain else None
    micro = 2
    batches = data(calls, replicas, ga=ga)
    replica = RANK // (WORLD // replicas)
    kw = dict(replicas=replicas, schedule=schedule, stages=stages, ga=ga, placement=placement)
    # ipukit's own trainingModel: under a launch it runs as processes (the same call as on threads)
    dist_model = (ipd.trainingModel if wrapper else poptorch.trainingModel)(
        net, options(mode, True, **kw),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    thr_model = poptorch.trainingModel(
        ref, options(mode, False, **kw),
        optimizer=torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    d_out, t_out = [], []
    for x, y in batches:
        d_out.append(dist_model(share(x, replica, replicas, micro), share(y, replica, replicas, micro)))
        t_out.append(thr_model(x, y))
    after = {}
    if plain:
        from helpers import reference_training

        opt = torch.optim.SGD(loop.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            reference_training(loop, opt, x, y, device_iterations=2, gradient_accumulation=ga,
                               replicas=1)
    if mode == poptorch.OutputMode.All and stages == 2 and placement is None:
        # an inference model of the trained module: each process's stages hold the trained
        # weights (nothing else was synchronised yet)
        x, y = batches[0]
        o = poptorch.Options().deviceIterations(4).replicationFactor(replicas)
        mb = x.shape[0] // (4 * replicas)  # the inference model's micro-batch
        d_inf = ipd.inferenceModel(net, o)(share(x, replica, replicas, mb),
                                           share(y, replica, replicas, mb))
        t_inf = poptorch.inferenceModel(ref, _plain(replicas))(x, y)
        after["inference_after_training"] = maxdiff(d_inf[0], share(t_inf[0], replica, replicas,
                                                                      mb))
    if wrapper:
        ipd.synchronize_weights(dist_model)
    else:
        dist_model.copyWeightsToHost()  # PopTorch's name: every stage's weights on every process
    result = {**after, "weights": max(maxdiff(p, q) for p, q in zip(net.parameters(), ref.parameters())),
              "buffers": max([maxdiff(p, q) for p, q in zip(net.buffers(), ref.buffers())
                              if p.is_floating_point()] or [0.0])}
    # the threaded call returns every replica's rows; this process gets its replica's
    outs, losses = [], []
    for (do, dl), (to, tl) in zip(d_out, t_out):
        if mode == poptorch.OutputMode.All:
            to = share(to, replica, replicas, micro)
            tl = tl.reshape(-1, replicas)[:, replica]
        elif replicas > 1:
            to = to.split(to.shape[0] // replicas)[replica]
            tl = tl[replica]
        outs.append(maxdiff(do, to))
        losses.append(maxdiff(dl, tl))
        result.setdefault("shapes", []).append([list(do.shape), list(dl.shape),
                                                list(to.shape), list(tl.shape)])
    result["outputs"], result["losses"] = max(outs), max(losses)
    if plain:
        result["plain"] = max(maxdiff(p, q) for p, q in zip(net.parameters(), loop.parameters()))
        result["trained"] = max(maxdiff(p, q) for p, q in
                                zip(net.parameters(), init.parameters()))
    rt = _runtime_of(dist_model)
    result["runner"] = type(rt.runner).__name__
    # how the replicas combine gradients, and whether this process's stages run under DDP
    result["sync"] = rt.replica_sync
    result["under_ddp"] = [isinstance(st.submod, torch.nn.parallel.DistributedDataParallel)
                           for st in rt.stages]
    tl = dist_model.getTimeline()
    schedule_ = dist_model.program.schedule
    result["kinds"] = sorted({e.kind for e in tl.events})
    result["stage_ipus"] = list(schedule_.stage_ipus)
    if RANK == 0:
        # the measured order on each virtual IPU is its lane of ipukit's schedule, iteration by
        # iteration (every process's spans, gathered on process 0)
        letter = {"forward": "F", "backward": "B", "input-grad": "I", "weight-grad": "W"}
        result["order"] = all(
            [str(a) for a in lane if a.kind != "S" and a.iteration == it]
            == [f"{e.stage}{letter[e.kind]}{e.micro_batch}"
                for e in sorted(tl.events, key=lambda e: e.start)
                if (e.replica, e.ipu, e.iteration) == (r, ipu, it) and e.kind in letter]
            for ipu, lane in zip(schedule_.lane_ipus, schedule_.lanes)
            for it in range(schedule_.iterations) for r in range(replicas))
        tracks = {}
        for e in tl.events:
            if e.ipu >= 0 and e.kind in ("forward", "backward"):
                tracks.setdefault(f"{e.replica}/{e.ipu}", []).append((e.start, e.end, e.kind))
        overlaps = 0
        for spans in tracks.values():
            spans.sort()
            for (a0, a1, _), (b0, b1, _) in zip(spans, spans[1:]):
                if b0 < a1 - 1e-9:
                    overlaps += 1
        result["tracks"] = sorted(tracks)
        result["overlaps"] = overlaps
        result["spans"] = {k: len(v) for k, v in tracks.items()}
    dist_model.destroy()
    thr_model.destroy()
    return result


def inference_pair(replicas=1):
    torch.manual_seed(2)
    net = SkipNet(2)
    x, y = data(1, replicas, di=4, ga=1)[0]
    replica = RANK // (WORLD // replicas)
    o = poptorch.Options().deviceIterations(4).replicationFactor(replicas)
    d = ipd.inferenceModel(net, o)
    t = poptorch.inferenceModel(net, _plain(replicas))
    do = d(share(x, replica, replicas, 2), share(y, replica, replicas, 2))
    to = t(x, y)
    return {"outputs": max(maxdiff(do[0], share(to[0], replica, replicas, 2)),
                           maxdiff(do[1], to[1].reshape(-1, replicas)[:, replica]))}


class TwoOutputsNet(SkipNet):
    """Stage 0's hidden state is a model output too: rows come from both processes."""

    def forward(self, x, labels):
        with poptorch.Block("b0", ipu_id=0):
            h0 = torch.tanh(self.inp(x))
        with poptorch.Block("b1", ipu_id=1):
            out = self.head(torch.tanh(self.mid[0](h0)) + h0)
            loss = torch.nn.functional.cross_entropy(out, labels)
        return h0, out, loss


def two_producers():
    """Outputs of both stages (each process holds some rows), mode All, over three calls."""
    torch.manual_seed(3)
    net = TwoOutputsNet(2)
    ref = copy.deepcopy(net)
    d = poptorch.trainingModel(net, options(poptorch.OutputMode.All),
                               optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    t = poptorch.trainingModel(ref, options(poptorch.OutputMode.All, False),
                               optimizer=torch.optim.SGD(ref.parameters(), lr=0.1))
    diffs = []
    for x, y in data(3, 1):
        do, to = d(x, y), t(x, y)
        diffs.append(max(maxdiff(a, b) for a, b in zip(do, to)))
        shapes = [list(v.shape) for v in do], [list(v.shape) for v in to]
    d.destroy(), t.destroy()
    return {"outputs": max(diffs), "shapes": shapes}


def measured_memory(micro=16, width=64, features=64):
    """Measured memory (``track_memory()``) of one training call as 2 processes and on threads,
    after an untracked one (compile, optimiser state, torch's receive buffers): the tracks on
    this process's timeline (process 0: every process's, gathered), the threads' tracks, per
    virtual IPU its stages' weight bytes; then a call only process 1 tracks."""
    torch.manual_seed(4)
    net = SkipNet(2, width=width, features=features)
    ref = copy.deepcopy(net)
    x, y = data(1, 1, micro=micro, features=features)[0]
    models = [poptorch.trainingModel(n, options(poptorch.OutputMode.Final, distributed),
                                     optimizer=torch.optim.SGD(n.parameters(), lr=0.1,
                                                               momentum=0.9))
              for n, distributed in ((net, True), (ref, False))]
    for m in models:
        m(x, y)
    untracked = [len(m.getTimeline().memory) for m in models]
    with poptorch.track_memory():
        for m in models:
            m(x, y)
    timeline = models[0].getTimeline()
    weights = {}
    for st in models[0].program.partition.stages:
        weights[st.ipu] = weights.get(st.ipu, 0) + sum(p.numel() * p.element_size()
                                                       for p in st.parameters)
    result = {"untracked": untracked, "weights": weights,
              "rows": (micro * 3 + 1) * 4,              # Final: the last logits and loss
              "activation": micro * width * 4,          # what stage 0 sends (and gets back)
              "micro_batches": models[0].program.schedule.micro_batches,
              "end": max(e.end for e in timeline.events),
              "processes": [m.to_dict() for m in timeline.memory],
              "threads": [m.to_dict() for m in models[1].getTimeline().memory]}
    if RANK == 0:   # the report beside the modeled bytes reads the gathered tracks
        from ipukit.viz.memory import measured_memory as report

        result["report"] = [[row["ipu"], row["measured_peak_bytes"]]
                            for row in report(models[0], timeline).rows]
    with poptorch.track_memory(RANK == 1):   # the processes need not agree on tracking
        models[0](x, y)
    result["only_process_1"] = [[m.replica, m.ipu] for m in models[0].getTimeline().memory]
    for m in models:
        m.destroy()
    return result


def _plain(replicas):
    p = poptorch.Options().deviceIterations(4).replicationFactor(replicas)
    p.Distributed.disable()
    return p


def expect_error(fn):
    try:
        fn()
    except DistributedError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return f"WRONG {type(exc).__name__}: {exc}"
    return "no error"


def wrong_count():
    net = SkipNet(2)
    o = options(poptorch.OutputMode.Final, replicas=2)  # needs 4 processes
    m = ipd.trainingModel(net, o)
    x, y = data(1, 1)[0]
    try:
        m(x, y)
    finally:
        m.destroy()


def mismatch():
    net = SkipNet(2)
    m = ipd.trainingModel(net, options(poptorch.OutputMode.Final))
    x, y = data(1, 1, micro=2 if RANK == 0 else 4)[0]
    try:
        m(x, y)
    finally:
        m.destroy()


#: the modern schedules on 2 processes: (Options.pipelineSchedule, virtual IPU of b0, b1, ...)
MODERN = {"interleaved-1f1b": ("Interleaved1F1B", [0, 1, 0, 1]),
          "looped-bfs": ("LoopedBFS", [0, 1, 0, 1]),
          "zb-h1": ("ZBH1", [0, 1]),
          "zbv": ("ZBV", [0, 1, 1, 0]),
          "dualpipev": ("DualPipeV", [0, 1, 1, 0])}


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        self.count = getattr(self, "count", 0) + 1
        out = super().step(closure)
        if RANK == 1 and self.count == 3:  # after updating: the call must still be undone
            raise ValueError("boom from the optimiser on rank 1")
        return out


def main():
    scenario = sys.argv[1]
    out = os.environ["IPUKIT_TEST_OUT"]
    results = {}
    t0 = time.perf_counter()
    All, Final, Sum = poptorch.OutputMode.All, poptorch.OutputMode.Final, poptorch.OutputMode.Sum
    if scenario == "pp2":
        results["all"] = train_pair(All)
        results["final"] = train_pair(Final, wrapper=True)
        results["sum"] = train_pair(Sum)
        results["gpipe"] = train_pair(All, schedule="GPipe")
        results["four_stages"] = train_pair(All, stages=4, ga=8)
        for name, (schedule, placement) in MODERN.items():
            results[name] = train_pair(All, schedule=schedule, stages=len(placement),
                                       placement=placement, plain=True)
        results["inference"] = inference_pair()
        results["two_producers"] = two_producers()
        results["wrong_count"] = expect_error(wrong_count)
        results["mismatch"] = expect_error(mismatch)
        results["fails_next"] = True
    elif scenario == "dp2pp2":
        results["all"] = train_pair(All, replicas=2, batchnorm=True)
        results["final"] = train_pair(Final, replicas=2)
        results["sum"] = train_pair(Sum, replicas=2)
        results["gpipe"] = train_pair(All, replicas=2, schedule="GPipe")
        # two stages per process (interleaved-1f1b, zbv), a split backward (zbv, zb-h1)
        for name in ("interleaved-1f1b", "zbv", "zb-h1"):
            schedule, placement = MODERN[name]
            results[name] = train_pair(All, replicas=2, schedule=schedule,
                                       stages=len(placement), placement=placement)
        results["inference"] = inference_pair(replicas=2)
    elif scenario == "memory":
        results["memory"] = measured_memory()
    elif scenario == "killed":  # rank 1 is killed (SIGKILL) in its second optimiser step
        if RANK == 0:  # outlive torchrun's SIGTERM: see what this process makes of the loss
            signal.signal(signal.SIGTERM, lambda *args: None)
        net = SkipNet(2)
        m = ipd.trainingModel(net, options(Final, di=1),
                              optimizer=KilledSGD(net.parameters(), lr=0.1))
        try:
            for x, y in data(5, 1, di=1):
                m(x, y)
        except BaseException as exc:
            with open(os.path.join(out, f"rank{RANK}-stopped.json"), "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}", "at": time.time()}, f)
            raise
    results["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)
    if scenario == "pp2":  # last: rank 1 raises in its third optimiser step; the run must end
        net = SkipNet(2)
        opt = FailingSGD(net.parameters(), lr=0.1, momentum=0.9)
        m = ipd.trainingModel(net, options(Final, di=1), optimizer=opt)
        try:
            for x, y in data(5, 1, di=1):
                before = [t.clone() for t in state_of(net, opt)]
                m(x, y)
        except BaseException as exc:  # this process's stages: as they were before the call
            after = state_of(net, opt)
            restored = len(after) == len(before) and all(torch.equal(a, b)
                                                          for a, b in zip(after, before))
            with open(os.path.join(out, f"rank{RANK}-stopped.json"), "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}", "restored": restored,
                           "momentum": len(opt.state), "calls": opt.count}, f)
            raise


class KilledSGD(torch.optim.SGD):
    def step(self, closure=None):
        self.count = getattr(self, "count", 0) + 1
        if RANK == 1 and self.count == 2:
            with open(os.path.join(os.environ["IPUKIT_TEST_OUT"], "killed-at.txt"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(closure)


def state_of(net, opt):
    """Weights, buffers and the optimiser's momentum (of the parameters this process trains)."""
    return (list(net.parameters()) + list(net.buffers())
            + [st["momentum_buffer"] for st in opt.state.values()])

if __name__ == "__main__":
    main()
