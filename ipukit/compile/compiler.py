"""Compiling a model: trace it on one micro-batch, cut it into stages, build a :class:`Program`.

PopTorch compiled a model for the IPU on its first call; ipukit "compiles" by
tracing the model on one micro-batch (:mod:`ipukit.partition`), checking the
batching options against the number of stages, choosing each virtual IPU's
torch device and building the call's schedule (:mod:`ipukit.schedule`). The
result is one frozen :class:`~ipukit.program.Program`.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, List, Optional

import torch
from .._torch import pytree

from ..core import anchors, batching as microbatch
from . import partition
from .. import schedules
from ..core.errors import Error, InputShapeError, OptionsError, PipelineConfigError, TracingError
from ..core.options import Options
from .program import Program, signature_of
from ..core.strategies import ShardedExecution


def compile_program(model: torch.nn.Module, opts: Options, training: bool, flat: List[Any],
                    spec, args, kwargs) -> Program:
    """The Program for ``model`` called with these (flattened) inputs under ``opts``."""
    started = time.perf_counter()
    check_batching_values(opts)
    batching = microbatch.Batching(opts.device_iterations,
                                   opts.Training.gradient_accumulation if training else 1,
                                   opts.replication_factor)
    names = input_names(model, args, kwargs)
    check_inputs(names, flat)
    micro = microbatch.split(flat, batching, names)
    mode = microbatch.resolve_output_mode(opts.output_mode, training)
    microbatch.check_period(mode, opts.output_return_period, batching)
    anchors.check(list(opts.anchored_tensors.values()), model, training)
    if opts.random_seed is not None:
        torch.manual_seed(opts.random_seed)
    strategy = opts.execution_strategy
    try:
        part = _partition(model, _on_weights_device(model, micro[0]), spec, strategy,
                          _several_stages_per_ipu(opts, training))
    except TracingError as exc:
        if "dtype" not in str(exc):
            raise
        raise InputShapeError(f"{exc}\n{dtype_hint(names, flat, model)}") from exc
    check_stage_counts(part.num_stages, strategy, opts, training, [st.ipu for st in part.stages],
                       [st.blocks[0] if st.blocks else f"B{st.index + 1}" for st in part.stages])
    _check_loss(part, training)
    devices = devices_for(part.ipus, opts.device_mapping)
    for st in part.stages:
        dev = devices[st.ipu]
        if dev.type != "cpu":
            st.module.to(dev)
    return Program(
        partition=part, schedule=build_schedule(part, strategy, opts, training),
        training=training, devices=devices, batching=batching, output_mode=mode,
        output_period=opts.output_return_period, input_names=tuple(names), in_spec=spec,
        signature=signature_of(flat, batching.factor),
        shapes=tuple((v.shape, v.dtype) if isinstance(v, torch.Tensor) else None for v in flat),
        tensor_inputs=tuple(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)),
        reduction=opts.Training.accumulation_and_replication_reduction_type,
        threads_per_worker=opts.cpu_threads_per_ipu,
        offload_optimizer=training and not opts.TensorLocations.on_chip("optimizer"),
        record=opts.record_timeline, compile_seconds=time.perf_counter() - started)


def _on_weights_device(model: torch.nn.Module, sample: List[Any]) -> List[Any]:
    """The trace sample on the device the weights are on (another model of the same
    module may have moved them to CUDA already)."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type == "cpu":
        return sample
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in sample]


def _check_loss(part: partition.Partition, training: bool) -> None:
    if not training:
        return
    n = part.num_stages
    if part.loss_output is None:
        raise Error("A training model must return its loss (a tensor): the model returned "
                    "no tensor output. Return the loss, e.g. `return output, loss`.")
    if n > 1:
        loss_ref = part.outputs[part.loss_output]
        if loss_ref.kind != "stage" or loss_ref.index != n - 1:
            where = "an input" if loss_ref.kind != "stage" else f"stage {loss_ref.index}"
            raise PipelineConfigError(
                f"The loss is computed in {where}, but the last pipeline stage is stage "
                f"{n - 1}: compute the loss in the last block (for example "
                "`with ipukit.Block(\"B4\"): loss = ...`).")


def _several_stages_per_ipu(opts: Options, training: bool) -> bool:
    """Whether the chosen schedule places several stages on one IPU (a loop or a V)."""
    from ..schedules.generators import LOOPED, V_SHAPED

    return training and schedules.kind_of(opts.pipeline_schedule) in LOOPED + V_SHAPED


def _partition(model: torch.nn.Module, sample, spec, strategy,
               split_stages: bool = False) -> partition.Partition:
    """Trace and split; a model that cannot be traced still runs as one eager stage."""
    try:
        return partition.trace(model, sample, spec, strategy, split_stages)
    except TracingError as trace_error:
        if strategy.stages:
            raise
        part = partition.eager(model, sample, spec)
        with partition.recording_blocks(strategy) as rec:
            partition.discover_eager_outputs(part, sample)
        if len(rec.segments) > 1:
            raise trace_error
        return part


def check_stage_counts(n: int, strategy, opts: Options, training: bool,
                       stage_ipus: Optional[List[int]] = None,
                       names: Optional[List[str]] = None) -> None:
    """PopTorch's pipeline depth rules (PopART's: a training pipeline of N stages has N − 1
    more backward stages, so it needs gradientAccumulation ≥ 2N − 1); the modern
    schedules need their placement and their own minimum (:mod:`ipukit.schedules`)."""
    if n <= 1 or isinstance(strategy, ShardedExecution):
        return
    o = opts
    kind = schedules.kind_of(o.pipeline_schedule)
    if training and kind not in ("1f1b", "gpipe"):
        from ..schedules.generators import check_placement, minimum_micro_batches

        ipus = stage_ipus if stage_ipus is not None else list(range(n))
        try:
            count = check_placement(kind, ipus, names)
        except schedules.ScheduleError as exc:
            raise PipelineConfigError(str(exc)) from None
        needed = minimum_micro_batches(kind, n, count)
        ga = o.Training.gradient_accumulation
        if ga < needed:
            raise PipelineConfigError(
                f"ipukit.Options().Training.gradientAccumulation must be at least {needed} for "
                f"pipelineSchedule({o.pipeline_schedule!r}) with {n} stages on {count} IPUs "
                f"(got {ga}). Set gradientAccumulation to {needed} or more.")
        return
    if training:
        needed = 2 * n - 1
        ga = o.Training.gradient_accumulation
        if ga < needed:
            raise PipelineConfigError(
                "ipukit.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({needed}) when using "
                f"ipukit.PipelinedExecution (got {ga}). Please note that a model with {n} "
                f"pipeline stages in ipukit (as in PopTorch) will have an additional {n - 1} "
                f"stages when training. Set gradientAccumulation to {needed} or more, or use "
                "ipukit.ShardedExecution.")
    elif o.device_iterations < n:
        raise PipelineConfigError(
            "ipukit.Options().deviceIterations must be greater than or equal to the number "
            f"of pipeline stages ({n}) when using ipukit.PipelinedExecution (got "
            f"{o.device_iterations}). Set deviceIterations to {n} or more, or use "
            "ipukit.ShardedExecution.")


def build_schedule(part: partition.Partition, strategy, opts: Options,
                   training: bool) -> schedules.Schedule:
    """The schedule of one call: the pipelined kind chosen, or the sharded one."""
    o = opts
    n = part.num_stages
    stage_ipus = [st.ipu for st in part.stages]
    sharded = isinstance(strategy, ShardedExecution) and n > 1
    if training:
        kind = "sharded" if sharded else schedules.kind_of(o.pipeline_schedule)
        try:
            return schedules.build(kind, n, o.Training.gradient_accumulation,
                                   o.device_iterations, stage_ipus)
        except schedules.ScheduleError as exc:
            raise PipelineConfigError(str(exc)) from None
    kind = "sharded-inference" if sharded else "inference"
    return schedules.build(kind, n, o.device_iterations, 1, stage_ipus)


def check_signature(program: Program, flat, spec) -> None:
    """Say how a call's inputs differ from those the program was compiled for."""
    old_spec, old_sig = program.in_spec, program.signature
    if spec == old_spec:  # a batch that is no multiple of the combined batch: say so first
        microbatch.split(flat, program.batching, program.input_names)
    factor = program.batching.factor
    new_sig = signature_of(flat, factor)
    if spec != old_spec or len(new_sig) != len(old_sig):
        raise InputShapeError(
            "The model was compiled for inputs of another structure (number or nesting of "
            "arguments changed). Call it with the same arguments it was compiled with, or "
            "call model.destroy() and wrap it again.")
    for name, old, new in zip(program.input_names, old_sig, new_sig):
        if old != new:
            if old[0] == "tensor" and new[0] == "tensor":
                old_shape = (old[1][0] * factor,) + old[1][1:] if old[1] else old[1]
                raise InputShapeError(
                    f"Input {name!r} changed after compile: the model was compiled for "
                    f"{list(old_shape)} ({old[2]}) per call, i.e. micro-batches of "
                    f"{list(old[1])}, and now gets micro-batches of {list(new[1])} "
                    f"({new[2]}). A compiled model, as in PopTorch, runs one input shape: "
                    "keep batches the same size (ipukit.DataLoader drops the incomplete "
                    "last batch by default), or call model.destroy() and wrap the model "
                    "again for the new shape.")
            raise InputShapeError(
                f"Input {name!r} changed after compile (was {old[1]}, now {new[1]}). "
                "Non-tensor inputs are fixed at compile time; call model.destroy() and wrap "
                "the model again.")


def devices_for(ipus: List[int], mapping: Optional[List[str]]) -> dict:
    """Virtual IPU → torch device: the option's list, else CUDA round-robin, else CPU."""
    if mapping:
        devices = {ipu: torch.device(mapping[ipu % len(mapping)]) for ipu in ipus}
        for device in set(devices.values()):
            if device.type == "cuda" and (not torch.cuda.is_available() or
                                          (device.index or 0) >= torch.cuda.device_count()):
                raise OptionsError(
                    f"Options.deviceMapping({list(mapping)}): {device} is not available here "
                    f"(CUDA available: {torch.cuda.is_available()}, devices: "
                    f"{torch.cuda.device_count()}). Map the virtual IPUs to devices this "
                    "machine has, e.g. deviceMapping(['cpu']), or leave it unset.")
        return devices
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        return {ipu: torch.device("cuda", k % n) for k, ipu in enumerate(ipus)}
    return {ipu: torch.device("cpu") for ipu in ipus}


def input_names(model: torch.nn.Module, args, kwargs) -> List[str]:
    """Readable names of the flat inputs (``data``, ``labels``, ``inputs[1]``)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"input{i}": a for i, a in enumerate(args)}
        named.update(kwargs)
    names = []
    for path, _ in pytree.tree_flatten_with_path(named)[0]:
        text = pytree.keystr(path)           # e.g. "['data']" or "['inputs'][1]"
        first, _, rest = text.partition("]")
        names.append(first.strip("['\"") + rest)
    return names


def check_batching_values(opts: Options) -> None:
    """Options set by direct assignment skip the setters' checks; check them once here."""
    for name, value in (("deviceIterations", opts.device_iterations),
                        ("replicationFactor", opts.replication_factor),
                        ("Training.gradientAccumulation", opts.Training.gradient_accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionsError(f"Options.{name} is {value!r}: it must be an int >= 1. Set it "
                               f"with the setter, e.g. Options().{name}(1).")


def check_inputs(names: List[str], flat: List[Any]) -> None:
    """Inputs a model cannot run on, said before tracing trips over them."""
    for name, v in zip(names, flat):
        if isinstance(v, torch.Tensor) and v.is_meta:
            raise InputShapeError(f"Input {name!r} is on the meta device (a shape without "
                                  "data): pass real tensors, e.g. torch.zeros(shape).")


def dtype_hint(names: List[str], flat: List[Any], model: torch.nn.Module) -> str:
    dtypes = ", ".join(f"{n}={v.dtype}" for n, v in zip(names, flat) if isinstance(v, torch.Tensor))
    param = next((p.dtype for p in model.parameters()), None)
    return (f"The inputs are {dtypes} and the model's parameters {param}: convert inputs the "
            "layers read to the parameters' type (e.g. data.float()); class labels stay integer.")
