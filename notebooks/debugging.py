"""Helpers for notebook 08 (they live beside the notebooks, not in ipukit).

The measurements behind notebook 08 ("Plan, fit, debug"): memory, a plan, a stall.

Each function builds a model, runs ipukit for real and returns plain numbers, so that
the notebook only calls and prints:

- :func:`measure_memory`: one training call measured with
  :func:`ipukit.runtime.memory_track.track_memory`, beside the modeled report
  (:func:`ipukit.viz.memory.measured_memory`); :func:`convnet_memory` /
  :func:`vit_memory` do it for the tutorial's convnet and the small ViT under several
  schedules and placements (GPipe, 1F1B, interleaved 1F1B, ZBV), with recomputation;
- a stage that stalls on purpose: :class:`GatedConvnet` (the convnet with an operation,
  :func:`stall_gate`, that waits on an ``threading.Event`` when armed by :func:`arm`),
  :func:`stall_on_threads` (the threads case: the StallError, the weights unchanged, the
  next call trains) and :data:`PROCESS_SCRIPT` / :func:`stalled_rank` (one rank of two
  that stops making progress under ``ipukit-run``), launched by :func:`launch_stall`.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

import ipukit
from ipukit.core.errors import StallError
import lessons
from ipukit.examples.mnist import Network, TrainingModelWithLoss
from ipukit.runtime.memory_track import track_memory
from ipukit.viz.memory import measured_memory

MIB = 2 ** 20

#: where each schedule puts the convnet's stages (one per block for the loops and the V)
CONVNET_PLACEMENTS = {"GPipe": (0, 0, 1, 1), "1F1B": (0, 0, 1, 1),
                      "Interleaved1F1B": (0, 1, 0, 1), "ZBV": (0, 1, 1, 0)}


# -- (1) memory, measured beside modeled -------------------------------------------------------

def measure_memory(network: nn.Module, opts: ipukit.Options, x: torch.Tensor, y: torch.Tensor,
                   lr: float = 0.01) -> Dict[str, object]:
    """Train ``network`` for one untracked call (compile, warm up), then one tracked call.

    Returns per virtual IPU the measured peak, its baseline (weights and optimiser state),
    the modeled bytes (:func:`ipukit.viz.memory.memory_report`, and ``modeled_ipu``: the
    stash of an IPU's stages at the same time, recomputation counted) and their ratio; the
    tracked call's timeline and seconds; the schedule that ran.
    """
    model = ipukit.trainingModel(network, opts, optimizer=torch.optim.SGD(network.parameters(),
                                                                          lr=lr))
    try:
        model(x, y)
        with track_memory():
            start = time.perf_counter()
            model(x, y)
            seconds = time.perf_counter() - start
        timeline = model.getTimeline()
        report = measured_memory(model, timeline)
        rows = [{"ipu": r["ipu"], "measured": r["measured_peak_bytes"],
                 "baseline": r["measured_baseline_bytes"], "modeled": r["modeled_bytes"],
                 "modeled_ipu": r["modeled_ipu_bytes"], "ratio": r["ratio"]}
                for r in report.rows]
        return {"schedule": model.program.schedule.kind, "rows": rows, "timeline": timeline,
                "seconds": seconds, "micro_batches": report.micro_batches,
                "stage_ipus": [st.ipu for st in model.program.partition.stages]}
    finally:
        model.destroy()


def convnet_memory(x: torch.Tensor, y: torch.Tensor,
                   placements: Optional[Dict[str, Sequence[int]]] = None,
                   micro_batch: int = 32, gradient_accumulation: int = 8,
                   recompute: Sequence[str] = (), seed: int = 0) -> Dict[str, Dict[str, object]]:
    """:func:`measure_memory` of the tutorial's convnet under each schedule of
    ``placements`` (schedule -> the IPU of each block B1–B4; default
    :data:`CONVNET_PLACEMENTS`), ``recompute`` naming the blocks whose stages recompute."""
    placements = CONVNET_PLACEMENTS if placements is None else placements
    batch = micro_batch * gradient_accumulation
    out = {}
    for kind, ipus in placements.items():
        net = lessons.convnet(seed)
        handles = lessons.recompute(net, recompute)
        one_per_ipu = len(set(ipus)) == len(ipus) or list(ipus) == sorted(ipus)
        opts = (lessons.options(ipus, gradient_accumulation, schedule=kind) if one_per_ipu else
                lessons.options(gradient_accumulation=gradient_accumulation, schedule=kind,
                                stage_ipus=ipus))
        try:
            out[kind] = measure_memory(net, opts, x[:batch], y[:batch])
        finally:
            for h in handles:
                h.remove()
    return out


def vit_stages(num_layers: int, kind: str) -> ipukit.PipelinedExecution:
    """The ViT's blocks on 2 virtual IPUs: 2 stages (1F1B, GPipe) or 4 (interleaved: IPUs
    0 1 0 1; ZBV: 0 1 1 0), the encoder layers split evenly."""
    layers = [f"Encoder{i}" for i in range(num_layers)]
    if kind in ("GPipe", "1F1B"):
        half = num_layers // 2
        parts, ipus = [["Embedding", *layers[:half]], [*layers[half:], "LayerNorm",
                                                      "Classifier"]], [0, 1]
    else:
        q = max(1, num_layers // 4)
        parts = [["Embedding", *layers[:q]], layers[q:2 * q], layers[2 * q:3 * q],
                 [*layers[3 * q:], "LayerNorm", "Classifier"]]
        ipus = [0, 1, 0, 1] if kind == "Interleaved1F1B" else [0, 1, 1, 0]
    return ipukit.PipelinedExecution(*(ipukit.Stage(*p).ipu(i) for p, i in zip(parts, ipus)))


def vit(num_layers: int = 4, seed: int = 0, recompute: bool = False) -> nn.Module:
    """The small ViT, one block per encoder layer (``recompute``: every layer recomputes)."""
    from ipukit.examples.vit import ViT

    torch.manual_seed(seed)
    return ViT(num_layers=num_layers).parallelize(ipukit.IPUConfig(
        layers_per_ipu=[1] * num_layers, ipus_per_replica=num_layers,
        recompute_checkpoint_every_layer=recompute))


def vit_memory(x: torch.Tensor, y: torch.Tensor, kinds: Sequence[str] = ("GPipe", "1F1B"),
               num_layers: int = 4, micro_batch: int = 16, gradient_accumulation: int = 8,
               recompute: bool = False, seed: int = 0) -> Dict[str, Dict[str, object]]:
    """:func:`measure_memory` of the ViT on 2 virtual IPUs under each schedule of ``kinds``."""
    batch = micro_batch * gradient_accumulation
    out = {}
    for kind in kinds:
        opts = ipukit.Options().pipelineSchedule(kind)
        opts.Training.gradientAccumulation(gradient_accumulation)
        opts.setExecutionStrategy(vit_stages(num_layers, kind))
        out[kind] = measure_memory(vit(num_layers, seed, recompute), opts, x[:batch], y[:batch])
    return out


# -- (3) a stage that stalls --------------------------------------------------------------------

GATE = {"count": 0, "at": None, "event": threading.Event(), "entered": threading.Event()}


@torch.library.custom_op("ipukit_examples::stall_gate", mutates_args=())
def stall_gate(x: torch.Tensor) -> torch.Tensor:
    """The identity, except its ``GATE['at']``-th run, armed by :func:`arm`, waits until
    the armed event is set: an operation that stops making progress."""
    GATE["count"] += 1
    if GATE["at"] is not None and GATE["count"] >= GATE["at"]:
        GATE["at"] = None
        GATE["entered"].set()
        GATE["event"].wait()
    return x.clone()


stall_gate.register_fake(lambda x: torch.empty_like(x))
stall_gate.register_autograd(lambda ctx, grad: grad,
                             setup_context=lambda ctx, inputs, output: None)


def arm(at_run: Optional[int]) -> threading.Event:
    """Make :func:`stall_gate`'s ``at_run``-th run from now wait (None: never); returns the
    event that releases it."""
    GATE.update(count=0, at=at_run, event=threading.Event(), entered=threading.Event())
    return GATE["event"]


class GatedNetwork(Network):
    """The tutorial's network with :func:`stall_gate` at the start of block B3."""

    def forward(self, x):
        with ipukit.Block("B1"):
            x = self.layer1(x)
        with ipukit.Block("B2"):
            x = self.layer2(x)
        with ipukit.Block("B3"):
            x = stall_gate(x.view(-1, 320))
            x = self.layer3_act(self.layer3(x))
        with ipukit.Block("B4"):
            x = self.layer4(x)
        return x


def gated_convnet(seed: int = 0) -> TrainingModelWithLoss:
    torch.manual_seed(seed)
    return TrainingModelWithLoss(GatedNetwork())


def state_of(net: nn.Module, optimizer) -> tuple:
    """Weights, buffers and optimiser state, copied."""
    return copy.deepcopy((net.state_dict(), optimizer.state_dict()))


def same_state(a, b) -> bool:
    """Whether two :func:`state_of` results (or parts of them) are exactly equal."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_state, a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def stall_model(timeout: float, gradient_accumulation: int = 4, seed: int = 0):
    """The gated convnet on 2 virtual IPUs (B1 B2 | B3 B4), 1F1B, SGD with momentum,
    ``Options.stallTimeout(timeout)``. Returns (training model, network, optimiser)."""
    net = gated_convnet(seed)
    opts = lessons.options((0, 0, 1, 1), gradient_accumulation).stallTimeout(timeout)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    return ipukit.trainingModel(net, opts, optimizer=optimizer), net, optimizer


def stall_on_threads(x: torch.Tensor, y: torch.Tensor, timeout: float = 2.0,
                     at_run: int = 3, gradient_accumulation: int = 4) -> Dict[str, object]:
    """Train one call, then stall the next at stage 1's ``at_run``-th forward.

    Returns the StallError's message, how long the stalled call took, whether the
    weights, buffers and optimiser state are as before it, the loss of the next call
    and whether that call changed the weights, and the worker threads left stuck."""
    model, net, optimizer = stall_model(timeout, gradient_accumulation)
    arm(None)
    model(x, y)
    before = state_of(net, optimizer)
    release = arm(at_run)
    started = time.perf_counter()
    error, stuck = None, []
    try:
        model(x, y)
    except StallError as exc:
        error, stuck = str(exc), list(exc.stuck)
    took = time.perf_counter() - started
    unchanged = same_state(state_of(net, optimizer), before)
    release.set()                        # the stuck operation returns; its worker ends
    _, loss = model(x, y)
    trained = not same_state(state_of(net, optimizer)[0], before[0])
    model.destroy()
    return {"error": error, "seconds": took, "unchanged": unchanged, "stuck": stuck,
            "next_loss": float(loss.float().mean()), "next_call_trained": trained,
            "timeout": timeout}


#: The script notebook 08 writes to a temporary folder and launches with ``ipukit-run``
#: (2 processes): rank 1's forward of its 2nd micro-batch waits until 4 s after it began
#: waiting; with ``stallTimeout(2)`` both processes stop, undo and report, then train on.
PROCESS_SCRIPT = f'''\
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import debugging

debugging.stalled_rank(out_dir=sys.argv[1], timeout=2.0, release_after=4.0)
'''


def stalled_rank(out_dir: str, timeout: float = 2.0, release_after: float = 4.0,
                 samples: int = 128) -> None:
    """One process of :data:`PROCESS_SCRIPT` (``RANK`` from torchrun): one call, then a call
    in which rank 1's stage stalls in :func:`stall_gate` (released ``release_after`` s
    after it entered), then one more call. Writes ``rank<R>.json``: the error's kind and
    message, the seconds to it, whether the state was undone, the next call's loss."""
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(samples, 1, 28, 28, generator=g), torch.randint(0, 10, (samples,),
                                                                        generator=g)
    model, net, optimizer = stall_model(timeout, gradient_accumulation=4)
    batch = 4 * 32
    x, y = x[:batch], y[:batch]
    arm(None)
    model(x, y)
    before = state_of(net, optimizer)
    if rank == 1:
        release = arm(2)

        def later():
            GATE["entered"].wait()
            time.sleep(release_after)
            release.set()

        threading.Thread(target=later, daemon=True).start()
    result = {"rank": rank}
    started = time.perf_counter()
    try:
        model(x, y)
        result["kind"], result["error"] = None, ""
    except Exception as exc:  # noqa: BLE001 - reported to the notebook
        result["kind"], result["error"] = type(exc).__name__, str(exc)
    result["stopped_after"] = time.perf_counter() - started
    result["unchanged"] = same_state(state_of(net, optimizer), before)
    arm(None)
    _, loss = model(x, y)
    result["next_loss"] = float(loss.float().mean())
    model.copyWeightsToHost()
    result["next_call_trained"] = not same_state(net.state_dict(), before[0])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def read_ranks(out_dir: str, nproc: int = 2) -> List[Dict[str, object]]:
    """The ``rank<R>.json`` files :func:`stalled_rank` wrote, rank 0 first."""
    found = []
    for r in range(nproc):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                found.append(json.load(f))
    return found


def launch_stall(out_dir: str, timeout: float = 600.0):
    """Write :data:`PROCESS_SCRIPT` into ``out_dir`` and launch it as 2 processes with
    ``ipukit-run`` (gloo on loopback, CUDA hidden, torchrun's variables of an outer launch
    dropped). Returns the finished launch (``subprocess.CompletedProcess``, output captured)
    and :func:`read_ranks`.

    A process whose group was torn down by the watchdog ends without the interpreter's
    finalization (ipukit flushes its output and exits with its status): destroying a gloo
    group whose connections were cut could otherwise abort it at exit.
    """
    script = os.path.join(out_dir, "stall.py")
    with open(script, "w") as f:
        f.write(PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    launch = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", "2",
                             "--timeout", "60", script, out_dir],
                            env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                            text=True, timeout=timeout)
    return launch, read_ranks(out_dir)
