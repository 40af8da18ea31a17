"""``trainingModel`` and ``inferenceModel``: PopTorch's model wrappers.

The wrapper (:class:`PoplarExecutor`, PopTorch's name) compiles on the first
call: it traces the model on one micro-batch, cuts it into stages
(:mod:`ipukit.partition`), checks the batching options against the number of
stages, and builds the call's schedule (:mod:`ipukit.schedule`). Each call
then splits the combined batch (:mod:`ipukit.microbatch`), runs the schedule
on per-IPU workers (:mod:`ipukit.executor`) and returns outputs per the output
mode. The stages share the user's ``Parameter`` objects, so the user's module,
a training model and an inference model of it always see the same weights.
"""
from __future__ import annotations

import inspect
import collections
import datetime
import time
import warnings
import weakref
from typing import Any, List, Optional

import torch
import torch.utils.hooks
from torch.utils import _pytree as pytree

from . import anchors, microbatch, partition, schedule as schedules
from .enums import OutputMode
from .errors import (Error, UnsupportedError, InputShapeError, ModelStateError, OptionsError,
                     PipelineConfigError, TracingError)
from .executor import CallRunner, Plan, StateSnapshot
from .options import Options
from .strategies import ShardedExecution
from .timeline import Event, Timeline

# PopTorch model methods that measured or stored IPU-only things: a clear error
# instead of an AttributeError naming the user's model class.
_TIMELINE = ("ipukit measures wall-clock spans instead: model.getTimeline() holds every "
             "micro-batch's forward/backward per virtual IPU and the host's work.")
_IPU_ONLY_METHODS = {
    "cycleCount": "there are no IPU cycles to count; " + _TIMELINE,
    "getPerfCounters": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getHostIpuLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getComputeLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "getIpuHostLatency": "there are no IPU host-transfer counters; " + _TIMELINE,
    "save": ("ipukit has no IPU executable to save; save the weights with "
             "torch.save(model.state_dict(), path)."),
    "compileAndExport": ("ipukit has no IPU executable to export; a model is traced when "
                         "first called. Save the weights with torch.save(model.state_dict(), "
                         "path) instead."),
    "loadExecutable": ("ipukit has no IPU executables; call the model (or "
                       "compile(*inputs)) to prepare it."),
}

_DESTROYED = ("This model was destroyed (model.destroy()) and can no longer run. Wrap the "
              "module again: ipukit.trainingModel(module, options, optimizer) or "
              "ipukit.inferenceModel(module, options).")

_NOT_COMPILED = ("Model has not been compiled or has been destroyed: call it (or "
                 "model.compile(*inputs)) first.")


def _devices_for(ipus: List[int], mapping: Optional[List[str]]) -> dict:
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


def _input_names(model: torch.nn.Module, args, kwargs) -> List[str]:
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


def _signature(flat: List[Any], factor: int) -> List[Any]:
    sig = []
    for v in flat:
        if isinstance(v, torch.Tensor):
            shape = list(v.shape)
            if shape:
                shape[0] //= factor
            sig.append(("tensor", tuple(shape), v.dtype))
        else:
            sig.append(("value", repr(v)))
    return sig


def _check_optimizer(optimizer, model: torch.nn.Module) -> None:
    """An optimizer must be a torch optimizer over (some of) this model's parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptionsError(
            f"trainingModel(optimizer={optimizer!r}): expected a torch.optim.Optimizer (or an "
            "ipukit.optim one) built over the model's parameters, e.g. "
            "ipukit.optim.SGD(model.parameters(), lr=0.01).")
    mine = {id(p) for p in model.parameters()}
    if mine and not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
        raise OptionsError(
            f"trainingModel(optimizer={type(optimizer).__name__}(...)): the optimizer updates "
            f"none of {type(model).__name__}'s parameters (it was built over another module's), "
            "so training would change nothing. Build it over this model: "
            f"{type(optimizer).__name__}(model.parameters(), ...).")


def _check_batching_values(opts: Options) -> None:
    """Options set by direct assignment skip the setters' checks; check them once here."""
    for name, value in (("deviceIterations", opts.device_iterations),
                        ("replicationFactor", opts.replication_factor),
                        ("Training.gradientAccumulation", opts.Training.gradient_accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionsError(f"Options.{name} is {value!r}: it must be an int >= 1. Set it "
                               f"with the setter, e.g. Options().{name}(1).")


def _check_inputs(names: List[str], flat: List[Any]) -> None:
    """Inputs a model cannot run on, said before tracing trips over them."""
    for name, v in zip(names, flat):
        if isinstance(v, torch.Tensor) and v.is_meta:
            raise InputShapeError(f"Input {name!r} is on the meta device (a shape without "
                                  "data): pass real tensors, e.g. torch.zeros(shape).")


def _dtype_hint(names: List[str], flat: List[Any], model: torch.nn.Module) -> str:
    dtypes = ", ".join(f"{n}={v.dtype}" for n, v in zip(names, flat) if isinstance(v, torch.Tensor))
    param = next((p.dtype for p in model.parameters()), None)
    return (f"The inputs are {dtypes} and the model's parameters {param}: convert inputs the "
            "layers read to the parameters' type (e.g. data.float()); class labels stay integer.")


def _cast_doubles(flat: List[Any]) -> List[Any]:
    """PopTorch ran no float64: double inputs become float32, as PopTorch converted them."""
    return [v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v
            for v in flat]


class PoplarExecutor:
    """A model wrapped for ipukit: call it like the module it wraps.

    Attribute access falls through to the wrapped module, so
    ``training_model.layer1.weight`` works as in PopTorch.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[Options], training: bool,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if options is None:
            options = Options()
        if not isinstance(options, Options):
            raise OptionsError(f"Invalid type: 'options' is of type {type(options).__name__} "
                               "(expected ipukit.Options).")
        options._freeze()
        opts = options.clone()
        if opts.defaultOutputMode():
            opts.outputMode(OutputMode.Final if training else OutputMode.All)
        if not training:
            if opts.Training.gradient_accumulation != 1:
                msg = ("You must set ipukit.Options().Training.gradientAccumulation to 1 or leave "
                       "it as its default value (1) when running an ipukit.inferenceModel() "
                       f"(got {opts.Training.gradient_accumulation}).")
                if not opts.is_sharded:
                    msg += (" Use ipukit.Options().deviceIterations() to process a sufficient "
                            "number of batches each run for pipelined execution instead.")
                raise PipelineConfigError(msg)
            if optimizer is not None:
                raise OptionsError("An inference model takes no optimizer.")
        elif not any(p.requires_grad for p in model.parameters()):
            raise ModelStateError(
                f"trainingModel({type(model).__name__}): the model has no trainable "
                "parameters, so there is nothing to train. Use ipukit.inferenceModel to run it, "
                "or give it parameters (requires_grad=True).")
        elif optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        else:
            _check_optimizer(optimizer, model)
        opts._freeze()
        d = self.__dict__
        d["_user_model"] = model
        d["_options"] = opts
        d["_training"] = training
        d["_optimizer"] = optimizer
        d["_plan"] = None
        d["_schedule"] = None
        d["_signature"] = None
        d["_attached"] = False
        d["_timeline"] = None
        d["_timelines_kept"] = []
        d["_calls"] = 0
        d["_input_names"] = None
        d["_shapes"] = None
        d["_output_mode"] = None
        d["_keep_rows"] = None
        d["_anchored"] = {}
        d["_compile_seconds"] = 0.0
        d["_positional_specs"] = {}
        d["_destroyed"] = False
        if training:
            _TRAINING_WRAPPERS[model] = weakref.ref(self)

    # -- attribute pass-through -------------------------------------------------
    def __getattr__(self, name: str):
        if name in _IPU_ONLY_METHODS:
            def unsupported(*args, **kwargs):
                raise UnsupportedError(f"{name}(): {_IPU_ONLY_METHODS[name]}")
            return unsupported
        return getattr(self.__dict__["_user_model"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self._user_model, name, value)

    def _not_copyable(self, *args):
        raise UnsupportedError(
            "An ipukit model wrapper cannot be copied, pickled or saved (neither could "
            "PopTorch's). Save or copy the wrapped module instead — "
            "torch.save(model.model.state_dict(), path) or copy.deepcopy(model.model) — and "
            "wrap the copy with ipukit.trainingModel/inferenceModel.")

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = __getstate__ = _not_copyable

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"ipukit.{kind}({self._user_model!r})"

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped user module (shares its parameters with every stage)."""
        return self._user_model

    @property
    def options(self) -> Options:
        """This model's (frozen) copy of the options, with ``Default`` resolved."""
        return self._options

    @property
    def training(self) -> bool:
        return self._training

    # -- compilation -----------------------------------------------------------
    def _batching(self) -> microbatch.Batching:
        o = self._options
        return microbatch.Batching(o.device_iterations,
                                   o.Training.gradient_accumulation if self._training else 1,
                                   o.replication_factor)

    def compile(self, *args, **kwargs) -> None:
        """Trace and partition the model for these inputs without running it."""
        if self._destroyed:
            raise ModelStateError(_DESTROYED)
        flat, spec = pytree.tree_flatten((args, kwargs))
        self._compile(flat, spec, args, kwargs)

    def _compile(self, flat, spec, args, kwargs) -> None:
        started = time.perf_counter()
        for hook in list(_PRE_COMPILE_HOOKS.values()):
            hook()
        opts = self._options
        _check_batching_values(opts)
        batching = self._batching()
        names = _input_names(self._user_model, args, kwargs)
        _check_inputs(names, flat)
        micro = microbatch.split(flat, batching, names)
        mode = microbatch.resolve_output_mode(opts.output_mode, self._training)
        microbatch.check_period(mode, opts.output_return_period, batching)
        anchors.check(list(opts.anchored_tensors.values()), self._user_model, self._training)
        if opts.random_seed is not None:
            torch.manual_seed(opts.random_seed)
        strategy = opts.execution_strategy
        try:
            part = self._partition(micro[0], spec, strategy)
        except TracingError as exc:
            if "dtype" not in str(exc):
                raise
            raise InputShapeError(f"{exc}\n{_dtype_hint(names, flat, self._user_model)}") from exc
        n = part.num_stages
        self._check_stage_counts(n, strategy)
        if self._training and part.loss_output is None:
            raise Error("A training model must return its loss (a tensor): the model returned "
                        "no tensor output. Return the loss, e.g. `return output, loss`.")
        if self._training and n > 1:
            loss_ref = part.outputs[part.loss_output]
            if loss_ref.kind != "stage" or loss_ref.index != n - 1:
                where = "an input" if loss_ref.kind != "stage" else f"stage {loss_ref.index}"
                raise PipelineConfigError(
                    f"The loss is computed in {where}, but the last pipeline stage is stage "
                    f"{n - 1}: compute the loss in the last block (for example "
                    "`with ipukit.Block(\"B4\"): loss = ...`).")
        devices = _devices_for(part.ipus, opts.device_mapping)
        for st in part.stages:
            dev = devices[st.ipu]
            if dev.type != "cpu":
                st.module.to(dev)
        plan = Plan(partition=part, training=self._training, devices=devices,
                    reduction=opts.Training.accumulation_and_replication_reduction_type,
                    threads_per_worker=opts.cpu_threads_per_ipu,
                    offload_optimizer=self._training and not opts.TensorLocations.on_chip("optimizer"),
                    record=opts.record_timeline)
        plan.tensor_inputs = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        self._plan = plan
        self._schedule = self._build_schedule(part, strategy)
        self._signature = (spec, _signature(flat, batching.factor))
        self._shapes = [(v.shape, v.dtype) if isinstance(v, torch.Tensor) else None for v in flat]
        self._output_mode = mode
        self._keep_rows = microbatch.kept_rows(mode, opts.output_return_period, batching)
        self._input_names = names
        self._attached = True
        self._compile_seconds = time.perf_counter() - started
        for hook in list(_POST_COMPILE_HOOKS.values()):
            hook()

    def _partition(self, sample, spec, strategy) -> partition.Partition:
        with partition._TRACE_LOCK:  # the block recorder is process-wide
            return self._partition_locked(sample, spec, strategy)

    def _partition_locked(self, sample, spec, strategy) -> partition.Partition:
        model = self._user_model
        try:
            return partition.trace(model, sample, spec, strategy)
        except TracingError as trace_error:
            if strategy.stages:
                raise
            part = partition.eager(model, sample, spec)
            with partition.recording_blocks(strategy) as rec:
                partition.discover_eager_outputs(part, sample)
            if len(rec.segments) > 1:
                raise trace_error
            return part

    def _check_stage_counts(self, n: int, strategy) -> None:
        if n <= 1 or isinstance(strategy, ShardedExecution):
            return
        o = self._options
        if self._training:
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

    def _build_schedule(self, part, strategy) -> schedules.Schedule:
        o = self._options
        n = part.num_stages
        stage_ipus = [st.ipu for st in part.stages]
        sharded = isinstance(strategy, ShardedExecution) and n > 1
        if self._training:
            kind = "sharded" if sharded else o.pipeline_schedule.lower()
            return schedules.build(kind, n, o.Training.gradient_accumulation,
                                   o.device_iterations, stage_ipus)
        kind = "sharded-inference" if sharded else "inference"
        return schedules.build(kind, n, o.device_iterations, 1, stage_ipus)

    # -- calls ------------------------------------------------------------------
    def _flatten(self, args, kwargs):
        """Flat inputs and their pytree spec; plain positional tensors skip pytree."""
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            spec = self.__dict__["_positional_specs"].get(len(args))
            if spec is None:
                spec = pytree.tree_flatten((args, kwargs))[1]
                self.__dict__["_positional_specs"][len(args)] = spec
            return list(args), spec
        return pytree.tree_flatten((args, kwargs))

    def __call__(self, *args, **kwargs):
        t_call = time.perf_counter()
        if self._destroyed:
            raise ModelStateError(_DESTROYED)
        flat, spec = self._flatten(args, kwargs)
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in flat):
            flat = _cast_doubles(flat)
        _warn_other_loader(flat, self)
        if self._plan is None:
            self._compile(flat, spec, args, kwargs)
            t_call = time.perf_counter()
        elif not self._same_inputs(flat, spec):
            self._check_signature(flat, spec)
        if not self._attached:
            self.attachToDevice()
        opts = self._options
        batching = self._batching()
        micro = microbatch.split(flat, batching, self._input_names)
        plan = self._plan
        plan.prepare_replicas(batching.replicas)
        snapshot = StateSnapshot(self._user_model, self._optimizer, weights=self._training)
        recorder = self._anchor_recorder(batching)
        runner = CallRunner(plan, self._schedule, micro, batching.replicas,
                            self._optimizer, clock_origin=t_call, call_index=self._calls,
                            anchors=recorder, keep_rows=self._keep_rows)
        t_run = time.perf_counter()
        try:
            runner.run(snapshot)
        except RuntimeError as exc:
            if self._calls or "dtype" not in str(exc) or isinstance(exc, Error):
                raise
            raise InputShapeError(f"{exc}\n{_dtype_hint(self._input_names, flat, self._user_model)}"
                                  ) from exc
        t_gather = time.perf_counter()
        part = plan.partition
        rows = runner.results
        for j, ref in enumerate(part.outputs):
            if ref.kind == "const":
                for row in rows:
                    row[j] = ref.value
            elif ref.kind == "input":
                for row, inputs in zip(rows, micro):
                    row[j] = inputs[plan.tensor_inputs[ref.index]]
        flat_out = microbatch.gather(rows, self._output_mode, opts.output_return_period, batching)
        result = pytree.tree_unflatten(flat_out, part.out_spec)
        if recorder is not None:
            self._anchored = recorder.results(self._output_mode, batching)
        self._calls += 1
        if plan.record:
            self._finish_timeline(runner, flat, batching, t_call, t_run, t_gather)
        return result

    def _finish_timeline(self, runner, flat, batching, t_call, t_run, t_gather) -> None:
        samples = 0
        for v in flat:
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                samples = v.shape[0]
                break
        tl = runner.timeline(samples)
        now = time.perf_counter()
        tl.events.insert(0, Event(-1, "host", -1, 0.0, t_run - t_call, -1, 0, 0, runner.call_index))
        tl.events.append(Event(-1, "host", -1, t_gather - t_call, now - t_call, -1, 0,
                               batching.device_iterations - 1, runner.call_index))
        tl.meta["model"] = self._options.model_name or ("training" if self._training else "inference")
        tl.meta["stage_ipus"] = list(self._schedule.stage_ipus)
        tl.meta["blocks"] = [st.blocks for st in self._plan.partition.stages]
        self._timeline = tl
        if self._options.profile_dir:
            from .profile import write_profile

            write_profile(tl, self._options.profile_dir, self)

    def _same_inputs(self, flat, spec) -> bool:
        """The cheap check on every call: same structure, shapes and dtypes as compiled."""
        shapes = self._shapes
        if len(flat) != len(shapes) or spec != self._signature[0]:
            return False
        for v, expected, sig in zip(flat, shapes, self._signature[1]):
            if expected is None:
                if isinstance(v, torch.Tensor) or repr(v) != sig[1]:
                    return False
            elif not isinstance(v, torch.Tensor) or v.shape != expected[0] or v.dtype != expected[1]:
                return False
        return True

    def _check_signature(self, flat, spec) -> None:
        old_spec, old_sig = self._signature
        if spec == old_spec:  # a batch that is no multiple of the combined batch: say so first
            microbatch.split(flat, self._batching(), self._input_names)
        factor = self._batching().factor
        new_sig = _signature(flat, factor)
        if spec != old_spec or len(new_sig) != len(old_sig):
            raise InputShapeError(
                "The model was compiled for inputs of another structure (number or nesting of "
                "arguments changed). Call it with the same arguments it was compiled with, or "
                "call model.destroy() and wrap it again.")
        for name, old, new in zip(self._input_names, old_sig, new_sig):
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

    def _anchor_recorder(self, batching) -> Optional[anchors.AnchorRecorder]:
        wanted = self._options.anchored_tensors
        if not wanted or not self._training:
            return None
        names = {id(p): n for n, p in self._user_model.named_parameters()}
        return anchors.AnchorRecorder(wanted.values(), self._plan.trainable, names,
                                      batching.factor, batching.device_iterations)

    # -- PopTorch's model methods ----------------------------------------------
    def getTensorNames(self) -> List[str]:
        """The tensors ``Options.anchorTensor`` can name for this model (see :mod:`ipukit.anchors`)."""
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)
        return anchors.tensor_names(self._user_model, self._training)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchored tensor from the last call."""
        wanted = self._options.anchored_tensors
        if short_name not in wanted:
            raise OptionsError(
                f"getAnchoredTensor({short_name!r}): no tensor anchored under that name; "
                f"anchored: {sorted(wanted) or 'none'}. Anchor it first with "
                f"options.anchorTensor({short_name!r}, 'Gradient___<parameter>').")
        if short_name not in self._anchored:
            raise ModelStateError(f"getAnchoredTensor({short_name!r}): run the model first; "
                                  "anchored tensors are recorded by each call.")
        return self._anchored[short_name]

    def getTimeline(self) -> Optional[Timeline]:
        """The measured :class:`~ipukit.Timeline` of the last call (None before any call)."""
        return self._timeline

    def isCompiled(self) -> bool:
        return self._plan is not None

    def isAttachedToDevice(self) -> bool:
        return self._plan is not None and self._attached

    def detachFromDevice(self) -> None:
        """Release the virtual IPUs (the next call attaches again)."""
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)
        if not self._attached:
            raise ModelStateError("Device is not attached: call attachToDevice() first, or just "
                                  "call the model, which attaches it.")
        self._attached = False

    def attachToDevice(self) -> None:
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)
        if self._attached:
            raise ModelStateError("Device is already attached.")
        self._attached = True

    def copyWeightsToHost(self) -> None:
        """Kept for PopTorch programs: weights are shared with the host module, nothing to copy."""
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)

    def copyWeightsToDevice(self) -> None:
        """Kept for PopTorch programs: weights are shared with the host module, nothing to copy."""
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)

    def copyNamedBuffersToDevice(self) -> None:
        """Kept for PopTorch programs: buffers are shared with the host module, nothing to copy."""
        self.copyWeightsToDevice()

    def compilationTime(self) -> datetime.timedelta:
        """How long tracing and partitioning the model took (its "compilation")."""
        if self._plan is None:
            raise ModelStateError(_NOT_COMPILED)
        return datetime.timedelta(seconds=self._compile_seconds)

    def copyWeightsToHostIfNeeded(self) -> bool:
        return False

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` (e.g. with a new learning rate) from the next call on."""
        if not self._training:
            raise ModelStateError("setOptimizer(): an inference model has no optimizer.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptionsError(f"setOptimizer({optimizer!r}): expected a torch.optim.Optimizer.")
        self._optimizer = optimizer

    def destroy(self) -> None:
        """Forget the compiled model and unwrap the module (it can be wrapped again).

        A destroyed wrapper no longer runs: calling it is an error, so two
        training wrappers of one module can never both train.
        """
        self._destroyed = True
        self._plan = None
        self._schedule = None
        self._signature = None
        self._attached = False
        if self._training and training_wrapper(self._user_model) is self:
            del _TRAINING_WRAPPERS[self._user_model]


# module -> its training wrapper (weakly on both sides). Kept out of the module's
# own attributes, so torch.save(module) and copy.deepcopy(module) work as usual.
_TRAINING_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def training_wrapper(model: torch.nn.Module) -> Optional[PoplarExecutor]:
    """The live training model wrapping ``model``, if any."""
    ref = _TRAINING_WRAPPERS.get(model)
    return None if ref is None else ref()


_PRE_COMPILE_HOOKS: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
_POST_COMPILE_HOOKS: "collections.OrderedDict[int, Any]" = collections.OrderedDict()


def _register(hooks: "collections.OrderedDict[int, Any]", hook) -> torch.utils.hooks.RemovableHandle:
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` before any model is compiled (traced); ``handle.remove()`` undoes it."""
    return _register(_PRE_COMPILE_HOOKS, hook)


def registerPostCompileHook(hook) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` after any model is compiled; ``handle.remove()`` undoes it."""
    return _register(_POST_COMPILE_HOOKS, hook)


def _warn_other_loader(flat, model: "PoplarExecutor") -> None:
    """A batch from an ipukit.DataLoader built for other Options changes the micro-batch size."""
    first = flat[0] if flat else None
    factor = getattr(first, "_ipukit_combined_factor", None)
    if factor is None or factor == model._batching().factor or model.__dict__.get("_loader_warned"):
        return
    model.__dict__["_loader_warned"] = True
    warnings.warn(
        f"ipukit: this batch comes from an ipukit.DataLoader built for Options with "
        f"{factor} micro-batches per call, but the model's Options take "
        f"{model._batching().factor} (deviceIterations × replicationFactor × "
        "gradientAccumulation), so each micro-batch holds a different number of samples than "
        "the DataLoader's batch_size. Build the DataLoader with the model's options "
        "(model.options).", stacklevel=3)


def _unwrap(model):
    return model._user_model if isinstance(model, PoplarExecutor) else model


def trainingModel(model: torch.nn.Module, options: Optional[Options] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> PoplarExecutor:
    """Wrap ``model`` (which returns its loss) for training; PopTorch's ``trainingModel``.

    The default optimizer, as in PopTorch, is ``SGD(lr=0.01)``.
    """
    model = _unwrap(model)
    if not isinstance(model, torch.nn.Module):
        raise OptionsError(f"trainingModel({model!r}): expected a torch.nn.Module.")
    if training_wrapper(model) is not None:
        raise ModelStateError(
            "Model has already been wrapped in 'ipukit.trainingModel'. Call model.destroy() on "
            "the existing training model to unwrap it before wrapping again.")
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: torch.nn.Module, options: Optional[Options] = None) -> PoplarExecutor:
    """Wrap ``model`` for inference; PopTorch's ``inferenceModel``.

    It shares weights with any training model of the same module: inference
    sees the latest training step.
    """
    model = _unwrap(model)
    if not isinstance(model, torch.nn.Module):
        raise OptionsError(f"inferenceModel({model!r}): expected a torch.nn.Module.")
    return PoplarExecutor(model, options, training=False)
