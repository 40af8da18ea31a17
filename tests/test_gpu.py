"""On CUDA: ipukit against plain PyTorch, stages sharing a GPU, and CUDA-event timing.

Skipped without CUDA (CI has none); run on a GPU machine with
``pytest -m gpu tests/test_gpu.py``.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(blocks, ipus, ga, di, sharded=False):
    torch.manual_seed(0)
    model = StackNet(blocks, ipus=ipus)
    ref = clone_model(model).cuda()
    opts = ipukit.Options().deviceIterations(di).deviceMapping(["cuda:0"])
    opts.Training.gradientAccumulation(ga)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                    momentum=0.9))
    x, y = make_data(2 * ga * di)
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                       x.cuda(), y.cuda(), device_iterations=di, gradient_accumulation=ga,
                       replicas=1)
    return model, ref, tm


@pytest.mark.parametrize("blocks,ipus,ga,sharded", [(1, [0], 1, False), (2, [0, 1], 3, False),
                                                    (4, [0, 1, 2, 3], 7, False),
                                                    (4, [0, 1, 2, 3], 2, True)])
def test_weights_equal_plain_pytorch_on_one_gpu(blocks, ipus, ga, sharded):
    model, ref, _ = _train(blocks, ipus, ga, 2, sharded)
    assert next(model.parameters()).is_cuda
    assert max_weight_diff(model, ref) < 1e-5


def test_cuda_event_spans_follow_the_pipeline():
    """Stages on one GPU share its stream: a stage's forward of a micro-batch starts after
    the previous stage's ended, and each virtual IPU's spans never overlap."""
    _, _, tm = _train(2, [0, 1], 3, 2)
    tl = tm.getTimeline()
    fwd = {(e.stage, e.iteration, e.micro_batch): e for e in tl.events if e.kind == "forward"}
    assert len(fwd) == 2 * 3 * 2
    for (stage, it, m), e in fwd.items():
        assert 0 <= e.start <= e.end <= tl.end
        if stage == 1:
            assert e.start >= fwd[(0, it, m)].end - 1e-6
    for ipu in (0, 1):
        spans = sorted((e.start, e.end) for e in tl.events
                       if e.ipu == ipu and e.kind in ("forward", "backward"))
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))


def test_a_second_model_of_a_module_already_on_cuda_compiles():
    """A training model moved the shared weights to CUDA; an inference model of the same
    module is traced with host inputs."""
    model, _, tm = _train(2, [0, 1], 3, 1)
    opts = ipukit.Options().deviceIterations(2).deviceMapping(["cuda:0"])
    out = ipukit.inferenceModel(model, opts)(torch.randn(4, 8))
    assert out.shape == (4, 4)



def test_calibrate_on_cuda_times_the_gpu_work_and_leaves_the_model_as_it_was():
    """``ipukit.calibrate`` of a model whose virtual IPUs map to the GPU (the default with
    CUDA): host sample inputs are moved to the weights' device for the measurements made
    outside a call, every cost is positive, each block's forward is not less than its
    work's queueing time alone (the host clock waits for the GPU), and the weights and the
    random state are those before."""
    torch.manual_seed(0)
    model = StackNet(4, ipus=[0, 1, 2, 3])
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    x, y = make_data(16)
    state = torch.random.get_rng_state()
    table = ipukit.calibrate(model, (x[:8], y[:8]), cache=False,
                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert table.device.startswith("cuda")
    assert all(f > 0 for f in table.forward) and all(b > 0 for b in table.backward)
    assert table.step > 0 and table.handoff > 0 and table.threads >= 1
    assert table.input_grad is not None and all(v > 0 for v in table.input_grad)
    assert torch.equal(torch.random.get_rng_state(), state)
    after = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    from ipukit.calibrate import model_call

    assert model_call(table, "1f1b", [[b] for b in table.blocks], 4).wall_time > 0


def test_process_recorder_times_spans_with_cuda_events_not_a_sync_per_action(monkeypatch):
    """Stages as processes (runtime._Recorder) on CUDA: each span is a placeholder until the
    call's one resolve(); the only synchronisations are the clock's reference (its first
    mark) and resolve's, none per action; the spans follow the work in order."""
    from test_distributed import recorder_on

    rec = recorder_on("cuda:0", monkeypatch)
    syncs = []
    synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: (syncs.append(device), synchronize(device))[1])
    a = torch.randn(2048, 2048, device="cuda:0")
    for m in range(6):
        start = rec.start()
        for _ in range(4):
            a = torch.tanh(a @ a / 2048)
        rec.span(m % 2, "F", m, start)
    assert len(syncs) == 1
    assert all(e.start == e.end == 0.0 for e in rec.events)
    rec.resolve()
    assert len(syncs) == 2
    spans = [(e.start, e.end) for e in rec.events]
    assert all(0 <= s < e for s, e in spans)
    assert all(x[1] <= y[0] + 1e-6 for x, y in zip(spans, spans[1:]))
    assert spans[-1][1] <= time.perf_counter() - rec.t0


#: Run by ipukit-run on 2 GPUs: a 2-stage training model, 2 calls; process 0 writes the
#: gathered timeline of the 2nd call and every process its torch.cuda.synchronize count in it.
PROCESS_WORKER = '''
import json, os, sys
import torch
import ipukit

class Deep(torch.nn.Module):
    def __init__(self, width=4096, depth=8):
        super().__init__()
        self.a = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.b = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x, labels):
        with ipukit.Block("b0", ipu_id=0):
            for layer in self.a:
                x = torch.tanh(layer(x))
        with ipukit.Block("b1", ipu_id=1):
            for layer in self.b:
                x = torch.tanh(layer(x))
            out = self.head(x)
            loss = torch.nn.functional.cross_entropy(out, labels)
        return out, loss

torch.manual_seed(0)
net = Deep()
opts = ipukit.Options().deviceIterations(2)
opts.Training.gradientAccumulation(4)
model = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=1e-3))
# micro-batches of 1024: a stage's forward is ~5 ms of fp32 matmuls on an H100
x, y = torch.randn(8 * 1024, 4096), torch.randint(0, 4, (8 * 1024,))
model(x, y)
syncs = []
synchronize = torch.cuda.synchronize
torch.cuda.synchronize = lambda device=None: (syncs.append(device), synchronize(device))[1]
model(x, y)
rank = int(os.environ["RANK"])
result = {"syncs": len(syncs), "device": torch.cuda.current_device()}
if rank == 0:
    result["events"] = [[e.stage, e.kind, e.micro_batch, e.iteration, e.ipu, e.start, e.end]
                        for e in model.getTimeline().events
                        if e.kind in ("forward", "backward")]
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
model.destroy()
torch.distributed.barrier()  # both done before the group goes
torch.distributed.destroy_process_group()
'''


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs a GPU per process (ipukit.distributed.group)")
def test_two_processes_on_cuda_time_the_pipeline_with_events(tmp_path):
    """2 processes, a stage each on its own GPU: the gathered timeline of CUDA-event spans
    follows the pipeline (per stage in micro-batch order; stage 1's forward of a micro-batch
    after stage 0's, stage 0's backward after stage 1's; no overlap on a virtual IPU), and a
    call synchronises once per process (resolve), not once per action."""
    script = tmp_path / "worker.py"
    script.write_text(PROCESS_WORKER)
    env = dict(os.environ, IPUKIT_DIST_TIMEOUT="60")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", "2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["device"] for r in results] == [0, 1]
    assert [r["syncs"] for r in results] == [1, 1]  # resolve's; 16 actions per process
    spans = {(s, k, m, it): (start, end) for s, k, m, it, _, start, end in results[0]["events"]}
    assert len(spans) == 2 * 2 * 2 * 4  # stages × (forward, backward) × iterations × GA
    skew = 1e-3  # the processes' clocks start at one barrier's exit, not at one instant (a
    # forward or backward here takes several ms: one that started early would fail this)
    for (s, k, m, it), (start, end) in spans.items():
        assert 0 <= start < end
        if k == "forward" and s == 1:
            assert start >= spans[(0, k, m, it)][1] - skew
        if k == "backward" and s == 0:
            assert start >= spans[(1, k, m, it)][1] - skew
    for s in (0, 1):
        for k in ("forward", "backward"):
            for it in (0, 1):
                starts = [spans[(s, k, m, it)][0] for m in range(4)]
                assert starts == sorted(starts)
    for ipu in (0, 1):
        track = sorted((start, end) for s, k, m, it, i, start, end in results[0]["events"]
                       if i == ipu and k in ("forward", "backward"))
        assert all(x[1] <= y[0] + 1e-6 for x, y in zip(track, track[1:]))


def test_a_sharded_call_on_one_gpu_runs_as_a_chain_timed_by_events_without_waiting(monkeypatch):
    """A sharded call with the timeline on, every stage on the one GPU, runs as a chain
    (one backward per micro-batch) whose clock readings are CUDA events: the call waits
    for the GPU only for the clock's reference and when the timeline is read, not once per
    micro-batch; the passes are in order on one track and the weights are a plain loop's."""
    from ipukit.runtime import fused

    ran = []
    run = fused.Chain.run
    monkeypatch.setattr(fused.Chain, "run", lambda self, actions: (ran.append(self),
                                                                   run(self, actions))[1])
    ga, di = 8, 2
    model, ref, tm = None, None, None
    torch.manual_seed(0)
    model = StackNet(4, ipus=[0, 1, 2, 3])
    ref = clone_model(model).cuda()
    opts = ipukit.Options().deviceIterations(di).deviceMapping(["cuda:0"])
    opts.Training.gradientAccumulation(ga)
    opts.setExecutionStrategy(ipukit.ShardedExecution())
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(2 * ga * di)
    tm(x, y)           # compiles; the clock's reference is taken
    syncs = []
    synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: (syncs.append(device), synchronize(device))[1])
    torch.manual_seed(0)
    fresh = StackNet(4, ipus=[0, 1, 2, 3])
    ref.load_state_dict(fresh.state_dict())
    model.load_state_dict(fresh.state_dict())
    tm(x, y)
    during = len(syncs)
    tl = tm.getTimeline()
    assert ran and during <= 1, during
    passes = sorted((e for e in tl.events if e.kind in ("forward", "backward")),
                    key=lambda e: e.start)
    assert len(passes) == 2 * 4 * ga * di
    assert all(0 <= e.start <= e.end for e in passes)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(passes, passes[1:]))
    first = [(e.kind, e.stage) for e in passes if e.micro_batch == 0 and e.iteration == 0]
    assert first == [("forward", s) for s in range(4)] + \
        [("backward", s) for s in reversed(range(4))]
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x.cuda(), y.cuda(),
                       device_iterations=di, gradient_accumulation=ga, replicas=1)
    assert max_weight_diff(model, ref) < 1e-5
