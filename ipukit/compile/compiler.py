"""Compiling a model: trace it on one micro-batch, cut it into stages, build a :class:`Program`
(check the batching against the stages, choose each virtual IPU's device, build the
schedule). PopTorch compiled for the IPU on the first call; so does ipukit.
"""
from __future__ import annotations

import collections
import inspect
import time
from typing import Any, List, Optional

import torch
from .._torch import pytree

from ..core import anchors, batching as microbatch
from . import partition
from .. import schedules
from ..core.errors import (LossError, InputShapeError, ModelStateError, OptionsError,
                           PipelineConfigError, TracingError)
from ..core.options import Options
from .program import Program, signature_of
from ..core.strategies import ShardedExecution
from ..schedules.generators import LOOPED, V_SHAPED


def compile_program(model: torch.nn.Module, opts: Options, training: bool, flat: List[Any],
                    spec, args, kwargs) -> Program:
    """The Program for ``model`` called with these (flattened) inputs under ``opts``."""
    started = time.perf_counter()
    check_batching_values(opts)
    batching = microbatch.Batching.of(opts, training)
    names = input_names(model, args, kwargs)
    check_inputs(names, flat)
    micro = microbatch.split(flat, batching, names)
    mode = microbatch.resolve_output_mode(opts.output_mode, training)
    microbatch.check_period(mode, opts.output_return_period, batching)
    anchors.check(list(opts.anchored_tensors.values()), model, training, batching, mode,
                  opts.output_return_period)
    check_updatable_buffers(model, opts)
    if opts.random_seed is not None:
        torch.manual_seed(opts.random_seed)
    strategy = opts.execution_strategy
    before, persistent = module_tensors(model), persistent_names(model)
    try:
        several = training and schedules.kind_of(opts.pipeline_schedule) in LOOPED + V_SHAPED
        part = _partition(model, _on_weights_device(model, micro[0]), spec, strategy, several,
                          training)
    except TracingError as exc:
        if "dtype" not in str(exc):
            raise
        raise InputShapeError(f"{exc}\n{dtype_hint(names, flat, model)}") from exc
    finally:
        changes = restore_module_tensors(model, before, persistent)
    if changes:
        raise ModelStateError(forward_change_message(*changes[0]))
    check_stage_counts(part.num_stages, strategy, opts, training, [st.ipu for st in part.stages],
                       [st.blocks[0] if st.blocks else f"B{st.index + 1}" for st in part.stages])
    _check_loss(part, training)
    devices = devices_for(part.ipus, opts.device_mapping)
    for st in part.stages:
        dev = devices[st.ipu]
        if dev.type != "cpu":
            st.module.to(dev)
    tensor_inputs = tuple(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor))
    # the wrapper copies the inputs changed in place (and writes them back): no executor copy
    mutated = _mutated_input_devices(part, tensor_inputs, devices)
    part.mutated_inputs = frozenset()
    return Program(
        partition=part, schedule=build_schedule(part, strategy, opts, training),
        training=training, devices=devices, batching=batching, output_mode=mode,
        output_period=opts.output_return_period, input_names=tuple(names), in_spec=spec,
        signature=signature_of(flat, batching.factor),
        shapes=tuple((v.shape, v.dtype) if isinstance(v, torch.Tensor) else None for v in flat),
        tensor_inputs=tensor_inputs,
        reduction=opts.Training.accumulation_and_replication_reduction_type,
        threads_per_worker=opts.cpu_threads_per_ipu,
        offload_optimizer=training and not opts.TensorLocations.on_chip("optimizer"),
        record=opts.record_timeline, track_memory=opts.track_memory,
        compile_seconds=time.perf_counter() - started,
        mutated_inputs=mutated, module_tensors=tuple(module_tensors(model).items()))


def _mutated_input_devices(part: partition.Partition, tensor_inputs, devices) -> dict:
    """Flat position of each input the model changes in place -> its first reader's device."""
    found = {}
    for index in sorted(part.mutated_inputs):
        if index >= len(tensor_inputs):
            continue
        device = next((devices.get(st.ipu, torch.device("cpu")) for st in part.stages
                       for ref in st.args if ref.kind == "input" and ref.index == index),
                      torch.device("cpu"))
        found[tensor_inputs[index]] = device
    return found


def module_tensors(model: torch.nn.Module) -> dict:
    """``(kind, name) -> tensor`` for every parameter and buffer of ``model``; ``kind`` is
    ``"Parameter"`` or ``"Buffer"`` (PopTorch's words in its messages)."""
    found = {("Buffer", n): b for n, b in model.named_buffers()}
    found.update({("Parameter", n): p for n, p in model.named_parameters()})
    return found


def changed_tensors(model: torch.nn.Module, compiled) -> list:
    """``(kind, name, how)`` for each compiled parameter or buffer that the module no longer
    holds: ``how`` is ``"removed"`` or ``"reassigned"`` (another tensor in its place)."""
    now = module_tensors(model)
    return [(kind, name, "removed" if now.get((kind, name)) is None else "reassigned")
            for (kind, name), tensor in (compiled.items() if isinstance(compiled, dict) else compiled)
            if now.get((kind, name)) is not tensor]


def put_back(model: torch.nn.Module, kind: str, name: str, tensor: torch.Tensor,
             persistent: bool = True) -> None:
    """Make ``tensor`` the module's parameter or buffer ``name`` again."""
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    held = dict(owner.named_parameters(recurse=False) if kind == "Parameter"
                else owner.named_buffers(recurse=False))
    if leaf not in held and hasattr(owner, leaf):
        delattr(owner, leaf)  # a plain attribute took the name: the tensor goes back in
    if kind == "Parameter" or leaf in held:
        setattr(owner, leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)


def persistent_names(model: torch.nn.Module) -> Optional[set]:
    """The names in ``model``'s state dict; None when its ``state_dict`` fails."""
    try:
        return set(model.state_dict(keep_vars=True))
    except Exception:  # noqa: BLE001 - a module whose state_dict fails
        return None


def restore_module_tensors(model: torch.nn.Module, before: dict,
                           persistent: Optional[set] = None) -> list:
    """Put back what the traced forward removed or reassigned (``persistent``: the
    :func:`persistent_names` from before); returns those changes (PopTorch refused them)."""
    changes = changed_tensors(model, before)
    if not changes:
        return changes
    if persistent is None:
        persistent = {name for _, name in before}
    for kind, name, _ in changes:
        try:
            put_back(model, kind, name, before[(kind, name)], name in persistent)
        except Exception:  # noqa: BLE001 - a submodule that is gone: nothing to put back into
            pass
    return changes


def forward_change_message(kind: str, name: str, how: str) -> str:
    """PopTorch's message for a forward that removes or reassigns a parameter or buffer."""
    if how == "removed":
        text = (f"{kind} {name} is removed from the model when calling the forward method.")
    else:
        text = (f"{kind} {name} is reassigned within the model when calling the forward "
                "method. This is not supported. Consider using "
                f"self.{name}.copy_(src) to copy data from a source tensor, where src is "
                "the name of the source tensor.")
    return (f"{text} The compiled model keeps using the {kind.lower()}s it was compiled "
            f"with, so forward must change a {kind.lower()} in place (copy_, add_, ...), "
            f"never assign or delete it. The module's {kind.lower()}s were put back as they "
            "were.")


def updatable_buffers(opts: Options) -> Optional[List[str]]:
    """The buffer names given to ``Options.updatableNamedBuffers`` (None when not set)."""
    names = opts.toDict().get("ignored", {}).get("updatableNamedBuffers")
    if names is None:
        return None
    return [names] if isinstance(names, str) else list(names)


def check_updatable_buffers(model: torch.nn.Module, opts: Options) -> None:
    """``Options.updatableNamedBuffers`` must name buffers the model has, as in PopTorch."""
    names = updatable_buffers(opts)
    if not names:
        return
    have = {n for n, _ in model.named_buffers()}
    missing = [n for n in names if n not in have]
    if missing:
        raise OptionsError(
            f"Options.updatableNamedBuffers({names}): {type(model).__name__} has no buffer "
            f"named {', '.join(repr(m) for m in missing)}; its buffers are "
            f"{sorted(have) or 'none'}. Name buffers as model.named_buffers() spells them.")


def _on_weights_device(model: torch.nn.Module, sample: List[Any]) -> List[Any]:
    """The trace sample on the weights' device (another model may have moved them already)."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type == "cpu":
        return sample
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in sample]


def _check_loss(part: partition.Partition, training: bool) -> None:
    if not training:
        return
    n = part.num_stages
    if part.loss_output is None:
        raise LossError("Couldn't find a loss in graph! A training model must return its loss "
                        "(a tensor): the model returned no tensor output. Return the loss, "
                        "e.g. `return output, loss`.")
    if n > 1:
        loss_ref = part.outputs[part.loss_output]
        if loss_ref.kind != "stage" or loss_ref.index != n - 1:
            where = "an input" if loss_ref.kind != "stage" else f"stage {loss_ref.index}"
            raise PipelineConfigError(
                f"The loss is computed in {where}, but the last pipeline stage is stage "
                f"{n - 1}: compute the loss in the last block (for example "
                "`with ipukit.Block(\"B4\"): loss = ...`).")


def _partition(model: torch.nn.Module, sample, spec, strategy,
               split_stages: bool = False, training: Optional[bool] = None
               ) -> partition.Partition:
    """Trace and split; a model that cannot be traced still runs as one eager stage."""
    try:
        return partition.trace(model, sample, spec, strategy, split_stages, training=training)
    except TracingError as trace_error:
        if strategy.stages:
            raise
        part = partition.eager(model, sample, spec)
        # a real forward: copies, so inputs changed in place change once per call
        own = [v.clone() if isinstance(v, torch.Tensor) else v for v in sample]
        with partition.recording_blocks(strategy) as rec:
            partition.discover_eager_outputs(part, own)
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
    o, ga = opts, opts.Training.gradient_accumulation
    kind = schedules.kind_of(o.pipeline_schedule)
    if training and kind not in ("1f1b", "gpipe"):
        from ..schedules.generators import check_placement, minimum_micro_batches

        ipus = stage_ipus if stage_ipus is not None else list(range(n))
        try:
            count = check_placement(kind, ipus, names)
        except schedules.ScheduleError as exc:
            raise PipelineConfigError(str(exc)) from None
        needed = minimum_micro_batches(kind, n, count)
        if ga < needed:
            raise PipelineConfigError(
                f"ipukit.Options().Training.gradientAccumulation must be at least {needed} for "
                f"pipelineSchedule({o.pipeline_schedule!r}) with {n} stages on {count} IPUs "
                f"(got {ga}). Set gradientAccumulation to {needed} or more.")
        return
    if training:
        needed = 2 * n - 1
        if ga < needed:
            raise PipelineConfigError(
                "poptorch.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({needed}) when using "
                "poptorch.PipelinedExecution. Please note that a model with "
                f"{n} pipeline stages in PopTorch will have an additional {n - 1} stages when "
                f"training. ipukit got {ga}: set gradientAccumulation to {needed} or more, "
                "or use ipukit.ShardedExecution.")
    elif o.device_iterations < n:
        raise PipelineConfigError(
            "poptorch.Options().deviceIterations must be greater than or equal to the number "
            f"of pipeline stages ({n}) when using PopTorch.PipelinedExecution. ipukit got "
            f"{o.device_iterations}: set deviceIterations to {n} or more, or use "
            "ipukit.ShardedExecution.")


def build_schedule(part: partition.Partition, strategy, opts: Options,
                   training: bool) -> schedules.Schedule:
    """The schedule of one call: the pipelined kind chosen, or the sharded one."""
    n, stage_ipus = part.num_stages, [st.ipu for st in part.stages]
    sharded = isinstance(strategy, ShardedExecution) and n > 1
    if training:
        kind = "sharded" if sharded else schedules.kind_of(opts.pipeline_schedule)
        try:
            return schedules.build(kind, n, opts.Training.gradient_accumulation,
                                   opts.device_iterations, stage_ipus)
        except schedules.ScheduleError as exc:
            raise PipelineConfigError(str(exc)) from None
    kind = "sharded-inference" if sharded else "inference"
    return schedules.build(kind, n, opts.device_iterations, 1, stage_ipus)


def input_change(program: Program, model: torch.nn.Module, flat, spec, args, kwargs) -> str:
    """How a call's inputs differ from the compiled ones, in PopTorch's words (``Shape mismatch for
    x: expected ... but got ...``): ipukit recompiles and warns with it. What stays an error is
    raised here first (``BatchSizeError``; a 0-d input when a call takes several micro-batches).
    """
    names = input_names(model, args, kwargs)
    check_inputs(names, flat)
    microbatch.split(flat, program.batching, names)
    old = list(zip(program.shapes, program.signature))
    found: List[str] = []
    _spec_changes(program.in_spec, spec, _top_names(model, args), iter(old), iter(flat), found)
    if not found:
        found.append("the inputs' structure changed")
    shown = found[:4]
    if len(found) > len(shown):
        shown.append(f"and {len(found) - len(shown)} more")
    return "; ".join(shown)


def _top_names(model: torch.nn.Module, args) -> List[str]:
    """Names of the positional arguments (``forward``'s parameter names where known)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    return [positional[i] if i < len(positional)
            else f"*{star}[{i - len(positional)}]" if star else f"args[{i}]"
            for i in range(len(args))]


def _describe_leaf(value) -> str:
    return "None" if value is None else "torch.Tensor" if isinstance(value, torch.Tensor) \
        else type(value).__name__


def _children(spec) -> list:
    """A pytree spec's child specs (``child(i)`` in newer torch, ``children_specs`` before)."""
    if hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


def _skip(spec, leaves) -> None:
    """Advance ``leaves`` past the leaves of ``spec``."""
    for _ in range(spec.num_leaves):
        next(leaves, None)


def _spec_changes(old, new, top: List[str], old_leaves, new_leaves, found: List[str],
                  path: str = "") -> None:
    """Walk the compiled and the new input structure side by side; note each difference."""
    if old.is_leaf() and new.is_leaf():
        (shape, sig), value = next(old_leaves), next(new_leaves)
        name = path or "input"
        if shape is None:  # compiled for a non-tensor value
            if isinstance(value, torch.Tensor):
                found.append(f"Type mismatch for {name}: expected {sig[1]} but got torch.Tensor")
            elif repr(value) != sig[1]:
                found.append(f"Value mismatch for {name}: expected {sig[1]} but got {value!r}")
        elif not isinstance(value, torch.Tensor):
            found.append(f"Type mismatch for {name}: expected torch.Tensor but got "
                         f"{_describe_leaf(value)}")
        elif value.dtype != shape[1]:
            found.append(f"Data type mismatch for {name}: expected {shape[1]} but got "
                         f"{value.dtype}")
        elif value.shape != shape[0]:
            found.append(f"Shape mismatch for {name}: expected {shape[0]} but got {value.shape}")
        return
    if old.is_leaf() or new.is_leaf() or old.type is not new.type:
        if old.is_leaf():
            shape, sig = next(old_leaves)
            was = "torch.Tensor" if shape is not None else sig[1]
        else:
            was = getattr(old.type, "__name__", str(old.type))
            _skip(old, old_leaves)
        if new.is_leaf():
            now = _describe_leaf(next(new_leaves))
        else:
            now = getattr(new.type, "__name__", str(new.type))
            _skip(new, new_leaves)
        found.append(f"Type mismatch for {path or 'inputs'}: expected {was} but got {now}")
        return
    old_children, new_children = _children(old), _children(new)
    args = not path and old.type is tuple and len(old_children) == 2  # (args, kwargs)
    if args and old_children[0].num_children != new_children[0].num_children:
        mismatch = ("Number of positional arguments mismatch: expected "
                    f"{old_children[0].num_children} arguments but got "
                    f"{new_children[0].num_children}")
    elif args:
        for i, (o, n) in enumerate(zip(_children(old_children[0]), _children(new_children[0]))):
            _spec_changes(o, n, top, old_leaves, new_leaves, found,
                          top[i] if i < len(top) else f"args[{i}]")
        return _keyed_changes(old_children[1], new_children[1], top, old_leaves, new_leaves,
                              found, "", keyword=True)
    elif old.type in (dict, collections.OrderedDict):
        return _keyed_changes(old, new, top, old_leaves, new_leaves, found, path)
    elif len(old_children) != len(new_children):
        mismatch = (f"Length mismatch for {path}: expected {len(old_children)} elements but "
                    f"got {len(new_children)}")
    elif old.context != new.context:  # a namedtuple's fields, a custom type's own context
        mismatch = (f"Structure mismatch for {path}: the {old.type.__name__} differs from "
                    "the one the model was compiled with")
    else:
        for i, (o, n) in enumerate(zip(old_children, new_children)):
            _spec_changes(o, n, top, old_leaves, new_leaves, found, f"{path}[{i}]")
        return
    found.append(mismatch)
    _skip(old, old_leaves)
    _skip(new, new_leaves)


def _keyed_changes(old, new, top, old_leaves, new_leaves, found, path, keyword=False) -> None:
    """A dict's (or the keyword arguments') differences: keys, then each common key."""
    old_keys, new_keys = list(old.context), list(new.context)
    if set(old_keys) != set(new_keys):
        extra = sorted(map(str, set(new_keys) - set(old_keys)))
        missing = sorted(map(str, set(old_keys) - set(new_keys)))
        details = ([f"Unexpected arguments: {', '.join(extra)}"] if extra else []) + \
                  ([f"Missing arguments: {', '.join(missing)}"] if missing else [])
        found.append(f"Keys mismatch for {path or 'named arguments'}: {'. '.join(details)}")
    elif old_keys != new_keys and not keyword:
        found.append(f"Keys order mismatch for {path}: expected {old_keys} but got {new_keys}")
    # walk the common keys (leaves of the others are skipped)
    new_at = dict(zip(new_keys, _children(new)))
    old_leaf_lists = [(key, spec, [next(old_leaves) for _ in range(spec.num_leaves)])
                      for key, spec in zip(old_keys, _children(old))]
    new_leaf_map = {key: [next(new_leaves) for _ in range(spec.num_leaves)]
                    for key, spec in zip(new_keys, _children(new))}
    for key, spec, leaves in old_leaf_lists:
        if key in new_at:
            _spec_changes(spec, new_at[key], top, iter(leaves), iter(new_leaf_map[key]), found,
                          str(key) if keyword else f"{path}[{key!r}]")


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
