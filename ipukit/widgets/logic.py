"""The explorer's pure logic (no ipywidgets): control values in, ipukit objects and figure data out.

A :class:`Config` holds the control values; :func:`training_options` and
:func:`strategy_for` turn it into :class:`ipukit.Options`; :func:`calibrated_costs`
measures a model's :class:`CostTable` with :func:`ipukit.calibrate` (cached per
process) and :func:`modeled_view` models one host call from it; :func:`probe`
compiles a configuration (no training) so that ipukit says whether PopTorch would
accept it; :func:`call_metrics` reads a training call's outputs.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.batching import returned_steps
from ..core.enums import AutoStage, OutputMode
from ..core.errors import Error
from ..core.options import Options, TensorLocationSettings
from ..schedules.registry import LOOPED, SCHEDULE_TITLES, V_SHAPED, kind_of
from ..schedules.generators import placement
from ..core.strategies import PipelinedExecution, ShardedExecution, Stage
from ..timeline.costs import CostTable, model_call
from ..timeline.events import Timeline

OUTPUT_MODES = ("All", "Final", "Sum", "EveryN", "Default")
#: Every pipelined schedule, by its ``Options.pipelineSchedule`` name (1F1B, ipukit's default, first).
SCHEDULES = ("1F1B",) + tuple(t for t in SCHEDULE_TITLES if t != "1F1B")
EXECUTIONS = ("pipelined", "sharded")
DEFAULT_BLOCKS = ("B1", "B2", "B3", "B4")

#: Host link bandwidth used to model offloaded optimiser state (bytes/s, each way).
HOST_LINK_BYTES_PER_S = 10e9
#: Largest number of events drawn in a timeline figure (the metrics use every event).
MAX_DRAWN_EVENTS = 2500


# -- stage splits ------------------------------------------------------------------------

def split_label(blocks: Sequence[str], split: Sequence[int]) -> str:
    """``("B1".."B4"), (0, 0, 1, 1)`` → ``"B1 B2 | B3 B4"``."""
    return " | ".join(" ".join(b for b, _ in g)
                      for _, g in itertools.groupby(zip(blocks, split), key=lambda bi: bi[1]))


def contiguous_splits(blocks: Sequence[str] = DEFAULT_BLOCKS) -> "OrderedDict[str, Tuple[int, ...]]":
    """Every way to cut the blocks into consecutive stages, most stages first:
    ``{"B1 B2 | B3 B4": (0, 0, 1, 1), ...}`` (the IPU of each block)."""
    n = len(blocks)
    splits = [tuple(itertools.accumulate((0,) + cuts))[:n]
              for cuts in itertools.product((1, 0), repeat=max(0, n - 1))]
    splits.sort(key=lambda s: (-(s[-1] + 1 if s else 0), s))
    return OrderedDict((split_label(blocks, s), s) for s in splits)


def parse_split(label: str, blocks: Sequence[str] = DEFAULT_BLOCKS) -> Tuple[int, ...]:
    """``"B1 B2 | B3 B4"`` → ``(0, 0, 1, 1)``; the blocks must appear in order, each once."""
    groups = [g.split() for g in label.split("|")]
    if [b for g in groups for b in g] != list(blocks) or any(not g for g in groups):
        raise ValueError(f"split {label!r}: list the blocks {list(blocks)} in order, "
                         "separating stages with '|'")
    return tuple(i for i, g in enumerate(groups) for _ in g)


# -- the control values ------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One setting of the dashboard's controls."""

    device_iterations: int = 10
    gradient_accumulation: int = 10
    micro_batch_size: int = 40
    split: str = "B1 | B2 | B3 | B4"
    output_mode: str = "All"
    output_return_period: int = 2
    sharded: bool = False
    schedule: str = "1F1B"
    offload_optimizer: bool = False
    replicas: int = 1
    learning_rate: float = 0.001
    blocks: Tuple[str, ...] = DEFAULT_BLOCKS
    model: str = "convnet"
    #: an IPUConfig's ``layers_per_ipu`` for a model placed by it (the ViT); () otherwise
    layers_per_ipu: Tuple[int, ...] = ()
    #: the IPU of each stage, when it is not stage ``s`` on IPU ``s``
    ipus: Tuple[int, ...] = ()
    #: where the model itself puts its stages (``ipus`` before a schedule placed them)
    model_ipus: Tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("blocks", "layers_per_ipu", "ipus", "model_ipus"):     # lists from JSON or asdict
            object.__setattr__(self, name, tuple(getattr(self, name)))

    split_ids = property(lambda self: parse_split(self.split, self.blocks))
    num_stages = property(lambda self: len(set(self.split_ids)))
    #: the virtual IPU of each stage
    stage_ipus = property(lambda self: self.ipus or tuple(range(self.num_stages)))
    #: placed by ``layers_per_ipu`` through an :class:`~ipukit.IPUConfig` (the ViT)
    layered = property(lambda self: bool(self.layers_per_ipu))
    #: micro-batches per replica in one call (DI × GA)
    micro_batches_per_call = property(lambda self: self.device_iterations
                                      * self.gradient_accumulation)
    #: samples one host call consumes: micro-batch × DI × GA × replicas
    combined_batch = property(lambda self: self.micro_batch_size * self.micro_batches_per_call
                              * self.replicas)

    @property
    def stage_blocks(self) -> List[List[str]]:
        ids = self.split_ids
        return [[b for b, i in zip(self.blocks, ids) if i == s] for s in range(len(set(ids)))]

    @property
    def schedule_kind(self) -> str:
        """The :func:`ipukit.simulate` kind: ``sharded``, or the schedule's (``1f1b``, ``zbv``...)."""
        if self.sharded and self.num_stages > 1:
            return "sharded"
        return kind_of(self.schedule) or self.schedule.lower()

    #: ``Default`` is ``Final`` for a training model
    resolved_output_mode = property(lambda self: "Final" if self.output_mode == "Default"
                                    else self.output_mode)

    def with_(self, **changes) -> "Config":
        return replace(self, **changes)

    def describe(self) -> str:
        execution = "sharded" if self.sharded else f"pipelined {self.schedule}"
        split = (f"{self.model}, layers_per_ipu {list(self.layers_per_ipu)}" if self.layered
                 else f"{self.model}, {self.split}")
        return (f"{split} · {execution} · DI {self.device_iterations} · "
                f"GA {self.gradient_accumulation} · micro-batch {self.micro_batch_size} · "
                f"output {self.output_mode}" + (" · optimiser offloaded" if self.offload_optimizer
                                                else ""))


def placed(config: Config) -> Config:
    """``config`` with its stages on the IPUs its schedule wants (:func:`ipukit.schedules.placement`:
    looped schedules ``s mod P``, V shapes ``i`` and ``2P − 1 − i``; others one stage per IPU).
    Raises :class:`ipukit.schedules.ScheduleError` (a ``ValueError``) when the stages do not fit."""
    kind = config.schedule_kind
    if kind not in LOOPED + V_SHAPED:
        return config
    return config.with_(ipus=tuple(placement(kind, config.num_stages)))


def example_config(model, split: Optional[str] = None,
                   layers_per_ipu: Optional[Sequence[int]] = None, **values) -> Config:
    """A :class:`Config` of ``model``, a model spec (``ipukit.examples.mnist.explorer_model()``).

    A model placed by stage split takes a ``split`` label (default: one block per stage);
    one placed by ``layers_per_ipu`` takes the counts (default: its own). Other keywords are
    :class:`Config` fields; the stages are :func:`placed`. Raises :class:`ipukit.Error` for
    counts that do not fit the model, a ``ValueError`` for stages the schedule cannot place.
    """
    from .models import layered_split

    if not model.layered:
        return placed(Config(model=model.name, blocks=tuple(model.blocks),
                             split=split or next(iter(contiguous_splits(model.blocks))), **values))
    layers = tuple(int(n) for n in (layers_per_ipu or model.default_layers))
    block_ipus, stage_ipus = layered_split(model, layers)
    ipus = () if stage_ipus == tuple(range(len(stage_ipus))) else stage_ipus
    return placed(Config(model=model.name, blocks=tuple(model.blocks),
                         split=split_label(model.blocks, block_ipus), layers_per_ipu=layers,
                         ipus=ipus, model_ipus=ipus, **values))


def strategy_for(config: Config) -> PipelinedExecution:
    """One :class:`~ipukit.Stage` per group of blocks, on the IPUs of :attr:`Config.stage_ipus`."""
    stages = [Stage(*names).ipu(ipu) for ipu, names in zip(config.stage_ipus, config.stage_blocks)]
    return (ShardedExecution if config.sharded else PipelinedExecution)(*stages)


def ipu_config_for(config: Config):
    """The :class:`~ipukit.IPUConfig` of a model placed by ``layers_per_ipu`` (the ViT)."""
    from .models import ipu_config_for as build

    return build(config.layers_per_ipu, device_iterations=config.device_iterations,
                 gradient_accumulation_steps=config.gradient_accumulation,
                 replication_factor=config.replicas,
                 optimizer_state_offchip=config.offload_optimizer)


def prepare_network(config: Config, network: torch.nn.Module,
                    wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """``wrap(network)``, or for a layered model ``network.parallelize(ipu_config)``."""
    if config.layered:
        return network.parallelize(ipu_config_for(config))
    return wrap(network)


def training_options(config: Config) -> Options:
    """The :class:`ipukit.Options` of a training run with these control values.

    A layered model starts from its IPUConfig's ``to_options()``, as optimum-graphcore's
    trainer did. Raises :class:`ipukit.Error` for values ipukit's setters reject.
    """
    if config.layered:
        opts = ipu_config_for(config).to_options()
        if config.sharded:
            opts.setExecutionStrategy(ShardedExecution(AutoStage.AutoIncrement))
        elif config.schedule_kind in LOOPED + V_SHAPED:   # on the IPUs the schedule wants
            opts.setExecutionStrategy(strategy_for(config))
    else:
        opts = Options().deviceIterations(config.device_iterations)
        opts.replicationFactor(config.replicas)
        opts.Training.gradientAccumulation(config.gradient_accumulation)
        opts.setExecutionStrategy(strategy_for(config))
    opts.pipelineSchedule(config.schedule)
    mode = OutputMode[config.output_mode]
    opts.outputMode(mode, config.output_return_period if mode == OutputMode.EveryN else None)
    if config.offload_optimizer:
        opts.TensorLocations.setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))
    return opts


def inference_options(config: Config, device_iterations: int) -> Options:
    """Options of an inference model with the same stages (gradient accumulation 1)."""
    opts = Options().deviceIterations(device_iterations)
    if config.layered:
        cls = ShardedExecution if config.sharded else PipelinedExecution
        opts.setExecutionStrategy(cls(AutoStage.AutoIncrement))
    else:       # inference runs the stages one per IPU, whatever the training schedule
        opts.setExecutionStrategy(strategy_for(config.with_(ipus=())))
    return opts


def host_calls_per_epoch(samples: int, config: Config) -> int:
    """Host calls in one epoch of ``samples`` (the DataLoader drops the incomplete last batch)."""
    return int(samples) // config.combined_batch


#: what the dashboard adds to an error that depends on the order the controls are moved in
ORDER_HINTS = (
    ("gradientAccumulation", "The controls can be moved in any order: raise gradient "
     "accumulation, or choose a schedule with two stages per IPU (ZBV, DualPipeV, "
     "Interleaved1F1B, LoopedBFS), and this message goes once the combination fits."),
    ("even number of stages", "The controls can be moved in any order: choose an even "
     "number of stages, or another schedule, and this message goes."),
)


def check_message(exc: BaseException) -> str:
    """The text the dashboard shows for an error: ipukit's message, then the first
    :data:`ORDER_HINTS` hint that applies."""
    text = f"{type(exc).__name__}: {exc}"
    hints = [hint for marker, hint in ORDER_HINTS if marker in text]
    return " ".join([text, *hints[:1]])


# -- costs --------------------------------------------------------------------------------

#: micro-batches each block is timed on when calibrating (the median is kept)
CALIBRATION_REPEATS = 12

_CALIBRATED: Dict[Tuple[int, int, int], Tuple[Any, CostTable]] = {}


def is_calibrated(model, micro_batch_size: int, repeats: int = CALIBRATION_REPEATS) -> bool:
    """Whether :func:`calibrated_costs` has this table already (it returns at once)."""
    return (id(model), int(micro_batch_size), int(repeats)) in _CALIBRATED


def calibrated_costs(model, micro_batch_size: int, repeats: int = CALIBRATION_REPEATS) -> CostTable:
    """``model``'s cost table on this machine at ``micro_batch_size``, from :func:`ipukit.calibrate`;
    blocks the spec says are ``alike`` get their group's median. Cached per model spec and
    micro-batch size in a process; ``notes["source"]`` says where it came from."""
    import statistics

    from ..calibrate import calibrate
    from ..core.optim import AdamW

    key = (id(model), int(micro_batch_size), int(repeats))
    if key in _CALIBRATED:
        return _CALIBRATED[key][1]
    module = model.calibration_module()
    table = calibrate(module, model.sample_batch(micro_batch_size), block_order=list(model.blocks),
                      repeats=repeats, optimizer=AdamW(module.parameters()))
    index = {b: i for i, b in enumerate(table.blocks)}
    changes: Dict[str, Any] = {"notes": {**table.notes, "source": "costs calibrated on this machine"}}
    for name in ("forward", "backward", "input_grad", "weight_grad"):
        values = getattr(table, name, None)
        if values is None:
            continue
        values = list(values)
        for group in getattr(model, "alike", ()):
            middle = statistics.median(values[index[b]] for b in group)
            for b in group:
                values[index[b]] = middle
        changes[name] = values
    table = replace(table, **changes)
    _CALIBRATED[key] = (model, table)
    return table


def calibrated_tables(model, repeats: int = CALIBRATION_REPEATS) -> List[CostTable]:
    """Every table :func:`calibrated_costs` holds for ``model``, smallest micro-batch first."""
    tables = [t for (ident, _, r), (_, t) in _CALIBRATED.items()
              if ident == id(model) and r == int(repeats)]
    return sorted(tables, key=lambda t: t.micro_batch)


def cost_source(costs: CostTable) -> str:
    """Where a cost table came from, as the figure titles say it."""
    return costs.notes.get("source") or "costs calibrated on this machine"


# -- the modeled view ---------------------------------------------------------------------

def offload_step_cost(config: Config, parameters: int) -> float:
    """Extra seconds per optimiser step to stream offloaded AdamW state (two float32 values
    per parameter) in and out over the host link."""
    if not config.offload_optimizer:
        return 0.0
    return 2.0 * int(parameters * 2.0 * 4) / HOST_LINK_BYTES_PER_S


def modeled_timeline(config: Config, costs: CostTable, parameters: int = 0) -> Timeline:
    """One host call of ``config`` modeled from ``costs`` (:func:`ipukit.timeline.costs.model_call`),
    one processor per virtual IPU. ``ValueError`` when the table is at another micro-batch size."""
    if costs.micro_batch and costs.micro_batch != config.micro_batch_size:
        raise ValueError(f"the cost table was measured at micro-batches of {costs.micro_batch}, "
                         f"the configuration has {config.micro_batch_size}: calibrate at that size")
    table = replace(costs, step=costs.step + offload_step_cost(config, parameters))
    return model_call(table, config.schedule_kind, config.stage_blocks,
                      config.gradient_accumulation, iterations=config.device_iterations,
                      replicas=config.replicas, stage_ipus=list(config.stage_ipus),
                      samples=config.combined_batch,
                      cores=len(config.stage_ipus) * config.replicas)


def clip_for_drawing(timeline: Timeline, max_events: int = MAX_DRAWN_EVENTS) -> Tuple[Timeline, str]:
    """The first device iterations of ``timeline`` that fit in ``max_events`` bars, and a note
    ("" when nothing was left out)."""
    if len(timeline.events) <= max_events:
        return timeline, ""
    iterations = max((e.iteration for e in timeline.events), default=0) + 1
    keep = max(1, max_events // max(1, len(timeline.events) // iterations))
    kept = [e for e in timeline.events if e.iteration < keep]
    return (Timeline(kept, timeline.modeled, dict(timeline.meta)),
            f"first {keep} of {iterations} device iterations drawn")


@dataclass
class ModeledView:
    """Everything the modeled view shows for one configuration."""

    config: Config
    timeline: Timeline
    utilisation: Dict[int, float]
    overall: float
    bubble: float                 # pipeline fill and drain, share of IPU time
    wall_time: float
    samples_per_second: float
    host_calls_per_epoch: int
    combined_batch: int
    cost_source: str
    drawn: Timeline = None
    drawn_note: str = ""
    time_per_step: float = 0.0
    breakdown: Dict[str, Any] = field(default_factory=dict)

    title = property(lambda self: f"Modeled call ({self.cost_source})")


def modeled_view(config: Config, costs: CostTable, samples_per_epoch: int,
                 parameters: int = 0) -> ModeledView:
    """Model one call of ``config``: speed, utilisation and where the idle time goes.

    ``bubble`` is the pipeline's fill and drain only (:meth:`ipukit.Timeline.idle_breakdown`).
    """
    tl = modeled_timeline(config, costs, parameters)
    u = tl.utilisation()
    b = tl.idle_breakdown()
    drawn, note = clip_for_drawing(tl)
    return ModeledView(config=config, timeline=tl, utilisation=dict(u["per_ipu"]),
                       overall=u["overall"], bubble=b["shares"]["bubble"], wall_time=tl.wall_time,
                       samples_per_second=tl.throughput(), combined_batch=config.combined_batch,
                       host_calls_per_epoch=host_calls_per_epoch(samples_per_epoch, config),
                       cost_source=cost_source(costs), drawn=drawn, drawn_note=note,
                       time_per_step=tl.time_per_step(), breakdown=b)


def rank_splits(config: Config, costs: CostTable, samples_per_epoch: int = 60000,
                splits: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Every stage split of ``config``'s blocks, modeled, fastest first (rows of ``split``,
    ``stages``, ``samples_per_second``, ``time_per_step``, ``utilisation``, ``bubble``)."""
    rows = []
    for label in (splits or contiguous_splits(config.blocks)):
        view = modeled_view(config.with_(split=label), costs, samples_per_epoch)
        rows.append({"split": label, "stages": config.with_(split=label).num_stages,
                     "samples_per_second": view.samples_per_second,
                     "time_per_step": view.time_per_step, "utilisation": view.overall,
                     "bubble": view.bubble})
    return sorted(rows, key=lambda r: -r["samples_per_second"])


def bar_values(utilisation: Dict[int, float]) -> List[float]:
    """Utilisation per virtual IPU in %, IPU 0 first (what the bar figures draw)."""
    return [100.0 * utilisation[k] for k in sorted(utilisation)]


# -- probing a configuration with ipukit ---------------------------------------------------

@dataclass
class ProbeResult:
    """What compiling a configuration (no training) tells: an error, or stages and memory."""

    error: Optional[str] = None
    error_type: Optional[str] = None
    report: Any = None                        # ipukit.viz.memory.MemoryReport
    stage_blocks: List[List[str]] = field(default_factory=list)
    parameters: int = 0

    ok = property(lambda self: self.error is None)


def sample_batch(template: Sequence[torch.Tensor], size: int) -> List[torch.Tensor]:
    """``size`` copies of one sample's tensors, as views (no memory for large calls)."""
    return [t.unsqueeze(0).expand(size, *t.shape) for t in template]


def probe(config: Config, network: torch.nn.Module, wrap: Callable[[torch.nn.Module], torch.nn.Module],
          template: Sequence[torch.Tensor],
          optimizer_factory: Optional[Callable] = None) -> ProbeResult:
    """Compile ``config`` for ``network`` (wrapped by ``wrap``) without training: an
    :class:`ipukit.Error` comes back as the result's ``error`` text, success holds the memory
    report of the compiled stages (:func:`ipukit.viz.memory.memory_report`)."""
    from ..model import trainingModel
    from ..viz.memory import memory_report

    def failed(exc):
        return ProbeResult(error=check_message(exc), error_type=type(exc).__name__)

    try:
        opts = training_options(config)
        module = prepare_network(config, network, wrap)
    except Error as exc:
        return failed(exc)
    if optimizer_factory is None:
        from ..core.optim import AdamW

        optimizer_factory = lambda params: AdamW(params, lr=config.learning_rate)  # noqa: E731
    model = trainingModel(module, opts, optimizer_factory(network.parameters()))
    try:
        model.compile(*sample_batch(template, config.combined_batch))
        report = memory_report(model)
        return ProbeResult(report=report, stage_blocks=[list(st["blocks"]) for st in report.stages],
                           parameters=sum(p.numel() for p in network.parameters()))
    except Error as exc:
        return failed(exc)
    finally:
        model.destroy()


# -- reading a training call's outputs ----------------------------------------------------

def returned_micro_batches(config: Config) -> Optional[List[int]]:
    """Indices (in call order, per replica) of the micro-batches whose outputs a call returns;
    ``None`` for ``Sum``."""
    mode = OutputMode[config.resolved_output_mode]
    if mode == OutputMode.Sum:
        return None
    return returned_steps(mode, config.output_return_period, config.micro_batches_per_call)


def call_metrics(predictions: torch.Tensor, losses: torch.Tensor, labels: torch.Tensor,
                 config: Config) -> Dict[str, Any]:
    """Loss and training accuracy of one call, from what the output mode returned.

    ``predictions`` counts the samples the accuracy was computed from. With ``Sum``
    there is no accuracy and the loss is the sum divided by the number of micro-batches.
    """
    losses = losses.detach().float()
    if config.resolved_output_mode == "Sum":
        loss = losses.sum().item() / (config.micro_batches_per_call * config.replicas)
        return {"loss": loss, "accuracy": None, "predictions": 0}
    loss = losses.mean().item()
    chosen, n = returned_micro_batches(config), predictions.shape[0]
    if chosen is not None:        # the labels of the samples whose predictions were returned
        grid = labels.reshape(config.micro_batches_per_call, config.replicas,
                              config.micro_batch_size, *labels.shape[1:])
        wanted = grid[chosen].reshape(-1, *labels.shape[1:])
    if chosen is None or wanted.shape[0] != n:
        return {"loss": loss, "accuracy": None, "predictions": n}
    correct = (predictions.argmax(dim=1) == wanted).sum().item()
    return {"loss": loss, "accuracy": 100.0 * correct / n, "predictions": n}


def utilisation_record(timeline: Optional[Timeline]) -> Dict[str, Any]:
    """Per-IPU utilisation, overall and bubble of a measured call (empty before any call)."""
    if timeline is None or not timeline.events:
        return {"per_ipu": {}, "overall": 0.0, "bubble": 1.0}
    u = timeline.utilisation()
    return {"per_ipu": dict(u["per_ipu"]), "overall": u["overall"], "bubble": u["bubble"]}


def format_summary(view: ModeledView, error: Optional[str] = None) -> str:
    """The modeled view's key numbers as a short HTML table."""
    per = " · ".join(f"IPU {k}: {100 * v:.0f}%" for k, v in sorted(view.utilisation.items()))
    b = view.breakdown.get("shares", {})
    idle = (f"bubble {100 * b.get('bubble', 0):.1f}% (textbook (N−1)/(M+N−1) "
            f"{100 * view.breakdown.get('textbook_bubble', 0):.1f}%) · imbalance "
            f"{100 * b.get('imbalance', 0):.1f}% · host {100 * b.get('host', 0):.1f}% · "
            f"optimiser step {100 * b.get('step', 0):.1f}%")
    rows = [
        ("modeled throughput", f"{view.samples_per_second:,.0f} samples/s"),
        ("modeled time per optimiser step", f"{1e3 * view.time_per_step:.2f} ms"),
        ("modeled call time", f"{1e3 * view.wall_time:.2f} ms"),
        ("combined batch per host call", f"{view.combined_batch:,} samples"),
        ("host calls per epoch", f"{view.host_calls_per_epoch:,}"),
        ("modeled utilisation", f"{100 * view.overall:.1f}% ({per})"),
        ("idle time, of all IPU time", idle),
        ("costs", view.cost_source),
    ] + ([("timeline", view.drawn_note)] if view.drawn_note else [])
    cells = "".join(f"<tr><td style='padding-right:1em'>{k}</td><td><b>{v}</b></td></tr>"
                    for k, v in rows)
    return f"<table style='font-size:90%'>{cells}</table>"


def error_html(message: Optional[str], heading: str = "PopTorch would reject this:") -> str:
    """The error box: empty when there is nothing to say."""
    if not message:
        return ""
    import html

    return ("<div style='border-left:4px solid #d9463e;background:#fdecea;padding:6px 10px;"
            f"white-space:pre-wrap;font-size:90%'><b>{html.escape(heading)}</b> "
            f"{html.escape(message)}</div>")
