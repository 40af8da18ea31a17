"""``trainingModel`` and ``inferenceModel``: PopTorch's model wrappers.

The wrapper (:class:`PoplarExecutor`) compiles on the first call into a frozen
:class:`~ipukit.compile.program.Program`; each call splits the combined batch, runs the
program's schedule on per-IPU workers and returns outputs per the output mode. The stages
share the user's ``Parameter`` objects, so the module and every wrapper of it see the same
weights. Inputs of another shape, dtype or structure recompile (with a warning; PopTorch
raised an error); inputs the model changes in place are written back to the caller's tensors.
"""
from __future__ import annotations

import abc
import collections
import contextlib
import datetime
import inspect
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.utils.hooks
from ._torch import pytree

from .core import anchors, batching as microbatch, optim
from .compile import compiler
from .core.blocks import module_repr
from .core.enums import OutputMode
from .core.errors import (Error, InputShapeError, ModelStateError, OptionsError,
                          PipelineConfigError, UnsupportedError)
from .runtime.executor import CallRunner, StateSnapshot
from .core.options import Options
from .compile.program import Program
from .timeline.events import Event, Timeline


# PopTorch model methods that measured or stored IPU-only things: a clear error
# instead of an AttributeError naming the user's model class.
_TIMELINE = ("ipukit measures wall-clock spans instead: model.getTimeline() holds every "
             "micro-batch's forward/backward per virtual IPU and the host's work.")
_COUNTERS = "there are no IPU host-transfer counters; " + _TIMELINE
_IPU_ONLY_METHODS = {
    "cycleCount": "there are no IPU cycles to count; " + _TIMELINE,
    **dict.fromkeys(("getPerfCounters", "getLatency", "getHostIpuLatency", "getComputeLatency",
                     "getIpuHostLatency"), _COUNTERS),
    "save": ("ipukit has no IPU executable to save; save the weights with "
             "torch.save(model.state_dict(), path)."),
    "compileAndExport": ("ipukit has no IPU executable to export; a model is traced when "
                         "first called. Save the weights with torch.save(model.state_dict(), "
                         "path) instead."),
    "loadExecutable": ("ipukit has no IPU executables; call the model (or "
                       "compile(*inputs)) to prepare it."),
}

ALREADY_WRAPPED = ("Model has already been wrapped in 'ipukit.trainingModel'. Call "
                   "model.destroy() on the existing training model to unwrap it before "
                   "wrapping again.")

NOT_COMPILED = ("Model has not been compiled or has been destroyed: call it (or "
                 "model.compile(*inputs)) first.")


def _name_parameters(optimizer, model: torch.nn.Module) -> None:
    """PopTorch's optimisers name their IPU state after the model's parameters."""
    if isinstance(optimizer, optim.Optimizer):
        optimizer.bind_parameter_names(model.named_parameters())


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


def _cast_doubles(flat: List[Any]) -> List[Any]:
    """PopTorch ran no float64: double inputs become float32, as PopTorch converted them."""
    return [v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v
            for v in flat]


def _checked_arguments(model: torch.nn.Module, options: Optional[Options], training: bool,
                       optimizer: Optional[torch.optim.Optimizer]):
    """PopTorch's checks of a wrapper's arguments; the model's frozen options (Default
    output mode resolved) and its optimiser (SGD(lr=0.01) when a training model has none)."""
    if options is None:
        options = Options()
    if not isinstance(options, Options):
        raise OptionsError(f"Invalid type: 'options' is of type {type(options).__name__} "
                           "(expected ipukit.Options).")
    options.freeze()
    opts = options.clone()
    if opts.defaultOutputMode():  # PopTorch's Default, resolved where every mode is
        opts.outputMode(microbatch.resolve_output_mode(OutputMode.Default, training))
    if not training:
        if opts.Training.gradient_accumulation != 1:
            msg = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
                   "it as its default value (1) when running a poptorch.inferenceModel().")
            if not opts.is_sharded:
                msg += (" Use poptorch.Options().deviceIterations to process a sufficient "
                        "number of batches each run for pipelined execution instead.")
            msg += f" (ipukit got gradientAccumulation({opts.Training.gradient_accumulation}).)"
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
    _name_parameters(optimizer, model)
    opts.freeze()
    return opts, optimizer


class InputBinder:
    """A call's arguments as a program's flat inputs (keyword arguments in ``forward``'s order)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._rank: Optional[dict] = None
        self._positional_specs: dict = {}

    def ordered_kwargs(self, kwargs: dict) -> dict:
        """``kwargs`` in ``forward``'s parameter order (PopTorch bound them by name), so the
        order a call names them in never makes them other inputs; ``**kwargs`` ones last."""
        if len(kwargs) < 2:
            return kwargs
        if self._rank is None:
            try:
                params = inspect.signature(self.module.forward).parameters.values()
                self._rank = {p.name: i for i, p in enumerate(params)
                              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            except (TypeError, ValueError):
                self._rank = {}
        rank = self._rank
        ordered = sorted((k for k in kwargs if k in rank), key=rank.__getitem__) + \
            [k for k in kwargs if k not in rank]
        if ordered == list(kwargs):
            return kwargs
        return {k: kwargs[k] for k in ordered}

    def flatten(self, args, kwargs):
        """Flat inputs and their pytree spec; plain positional tensors skip pytree."""
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            spec = self._positional_specs.get(len(args))
            if spec is None:
                spec = pytree.tree_flatten((args, kwargs))[1]
                self._positional_specs[len(args)] = spec
            return list(args), spec
        return pytree.tree_flatten((args, kwargs))


class TensorWatch:
    """Refuses a call after a parameter or buffer the program holds was replaced or removed.

    Checked in full only when torch registered a parameter, buffer or module anywhere since
    the last check, so a call pays nothing otherwise."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.seen: Optional[int] = None

    @staticmethod
    def count() -> int:
        return _REGISTRATIONS[0]

    def checked(self) -> None:
        self.seen = _REGISTRATIONS[0]

    def before_call(self, program: Program) -> None:
        if self.seen == _REGISTRATIONS[0]:
            return
        changes = compiler.changed_tensors(self.module, program.module_tensors)
        if changes:
            raise ModelStateError(_host_change_message(*changes[0]))
        self.checked()

    def after_call(self, program: Program, snapshot, registrations: int) -> None:
        """An eager forward that replaced or removed a parameter or buffer: undo the call, raise."""
        if _REGISTRATIONS[0] == registrations:  # nothing was assigned while it ran
            return
        changes = compiler.changed_tensors(self.module, program.module_tensors)
        if changes:
            compiled = dict(program.module_tensors)
            for kind, name, _ in changes:
                with contextlib.suppress(Exception):  # a submodule that is gone
                    compiler.put_back(self.module, kind, name, compiled[(kind, name)])
            snapshot.restore()
            raise ModelStateError(compiler.forward_change_message(*changes[0]))
        self.checked()

    def copy_to_device(self, program: Program, which) -> None:
        """Copy each replaced parameter/buffer's values into the compiled tensor (everything
        is checked before anything is written)."""
        model = self.module
        changes = compiler.changed_tensors(model, program.module_tensors)
        if which is not None:
            kind, names = which
            changes = [c for c in changes if c[0] == kind and (names is None or c[1] in names)]
        compiled = dict(program.module_tensors)
        now = compiler.module_tensors(model)
        for kind, name, how in changes:
            if how == "removed":
                raise ModelStateError(_host_change_message(kind, name, how))
            new, old = now[(kind, name)], compiled[(kind, name)]
            if new.shape != old.shape:
                raise ModelStateError(
                    f"{kind} {name} is reassigned within the model with shape "
                    f"{list(new.shape)}, but the model was compiled with shape "
                    f"{list(old.shape)}: its values cannot be copied into the compiled one. "
                    "Call model.destroy() and call the model again to recompile for it.")
        with torch.no_grad():
            for kind, name, _ in changes:
                old = compiled[(kind, name)]
                old.copy_(now[(kind, name)])
                compiler.put_back(model, kind, name, old)
        self.seen = None  # check in full at the next call


class PoplarExecutor:
    """A model wrapped for ipukit: call it like the module it wraps.

    Attribute access falls through to the wrapped module, so
    ``training_model.layer1.weight`` works as in PopTorch.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[Options], training: bool,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        opts, optimizer = _checked_arguments(model, options, training, optimizer)
        d = self.__dict__
        d["_user_model"] = model
        d["_options"] = opts
        d["_training"] = training
        d["_optimizer"] = optimizer
        d["_program"] = None
        d["_attached"] = False
        d["_timeline"] = None
        d["_timeline_source"] = None
        d["_loader_warned"] = False
        d["_calls"] = 0
        d["_anchored"] = {}
        d["_inputs"] = InputBinder(model)      # a call's arguments → flat inputs
        d["_watch"] = TensorWatch(model)       # the module's tensors the program holds
        d["_destroyed"] = False
        d["_snapshot"] = StateSnapshot()
        d["runtime_state"] = {}                # the process runtime's; forgotten by destroy()
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
        """The wrapped module, its BeginBlocks shown (PopTorch's ``module_repr``)."""
        return module_repr(self._user_model)

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped user module (shares its parameters with every stage)."""
        return self._user_model

    @property
    def options(self) -> Options:
        """This model's (frozen) copy of the options, with ``Default`` resolved."""
        return self._options

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimiser a training model steps (None for an inference model)."""
        return self._optimizer

    @property
    def training(self) -> bool:
        return self._training

    @property
    def program(self) -> Optional[Program]:
        """What compiling produced (stages, schedule, batching, ...); None before compiling."""
        return self._program

    # -- compilation -----------------------------------------------------------
    def _batching(self) -> microbatch.Batching:
        return microbatch.Batching.of(self._options, self._training)

    def compile(self, *args, **kwargs) -> None:
        """Trace and partition the model for these inputs without running it (after
        ``destroy()`` too: it compiles again, as PopTorch did)."""
        kwargs = self._inputs.ordered_kwargs(kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        self._compile(flat, spec, args, kwargs)

    def _compile(self, flat, spec, args, kwargs) -> None:
        """Compile for these inputs. The wrapper changes only once compiling succeeded: a
        failed (re)compile leaves the previous program, or the destroyed state, as it was."""
        model = self._user_model
        if self._destroyed and self._training:
            other = training_wrapper(model)
            if other is not None and other is not self:
                raise ModelStateError(
                    f"{ALREADY_WRAPPED} This model was destroyed and another training model "
                    "of the module was made since: train with that one, or destroy it first.")
        for hook in list(_PRE_COMPILE_HOOKS.values()):
            hook()
        _watch_registrations()
        program = compiler.compile_program(model, self._options, self._training, flat, spec,
                                           args, kwargs)
        self._program = program
        self._attached = True
        self._watch.checked()
        if self._destroyed:  # called again after destroy(): wrapped again, as in PopTorch
            self._destroyed = False
            if self._training:
                _TRAINING_WRAPPERS[model] = weakref.ref(self)
        for hook in list(_POST_COMPILE_HOOKS.values()):
            hook()

    def _recompile(self, flat, spec, args, kwargs) -> None:
        """A call whose inputs differ from the compiled ones: compile again, and say why."""
        reason = compiler.input_change(self._program, self._user_model, flat, spec, args,
                                       kwargs)
        self._compile(flat, spec, args, kwargs)
        warnings.warn(
            f"ipukit recompiled the model for new inputs: {reason}. The weights and the "
            "optimiser state are kept. (PopTorch raised an error for such a call; each "
            "recompile traces the model again, so keep inputs the same to avoid it, e.g. "
            "ipukit.DataLoader drops the incomplete last batch.)", UserWarning, stacklevel=3)

    # -- calls ------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        t_call = time.perf_counter()
        if kwargs:
            kwargs = self._inputs.ordered_kwargs(kwargs)
        if self._options.Distributed.numProcesses > 1:  # launched by ipukit-run / torchrun
            from .runtime.processes import runtime as distributed

            out = distributed.maybe_run(self, args, kwargs)
            if out is not distributed.NOT_DISTRIBUTED:
                self._keep_timeline(distributed.timeline_source(self))
                return out
        flat, spec = self._inputs.flatten(args, kwargs)
        callers = flat
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in flat):
            flat = _cast_doubles(flat)
        _warn_other_loader(flat, self)
        program = self._program
        if program is None or not program.same_inputs(flat, spec):
            (self._compile if program is None else self._recompile)(flat, spec, args, kwargs)
            program, t_call = self._program, time.perf_counter()
        else:
            self._watch.before_call(program)
        if not self._attached:
            self.attachToDevice()
        batching = program.batching
        micro = microbatch.split(flat, batching, program.input_names)
        if program.mutated_inputs:
            _own_copies(micro, program.mutated_inputs)
        program.prepare_replicas(batching.replicas, self._options.broadcast_buffers)
        state = self._user_model
        if not self._options.broadcast_buffers and program.replica_modules:
            # replicas keep their own buffers across calls: a failed call restores them too
            state = torch.nn.ModuleList([self._user_model, *program.replica_modules.values()])
        recorder = self._anchor_recorder(batching)
        runner = CallRunner(program, program.schedule, micro, batching.replicas,
                            self._optimizer, clock_origin=t_call, call_index=self._calls,
                            anchors=recorder, keep_rows=program.keep_rows,
                            stall_timeout=self._options.stall_timeout)
        with runner.host_threads():  # the host's work beside workers: a worker's threads
            snapshot = self._snapshot.capture(state, self._optimizer, self._training)
            registrations = self._watch.count()
            t_run = time.perf_counter()
            try:
                runner.run(snapshot)
            except RuntimeError as exc:
                if self._calls or "dtype" not in str(exc) or isinstance(exc, Error):
                    raise
                hint = compiler.dtype_hint(program.input_names, flat, self._user_model)
                raise InputShapeError(f"{exc}\n{hint}") from exc
            self._watch.after_call(program, snapshot, registrations)
            t_gather = time.perf_counter()
            if program.mutated_inputs:
                _write_back(callers, micro, program.mutated_inputs)
            result = _outputs(program, runner.results, micro)
            if recorder is not None:
                self._anchored = recorder.results(program.output_mode, batching,
                                                  program.output_period)
        self._calls += 1
        if program.record:
            self._keep_timeline(_call_timeline(self, runner, flat, t_call, t_run, t_gather))
        return result

    def _keep_timeline(self, timeline) -> None:
        """Keep the last call's timeline, written out when ``profileDir`` is set (with stages
        as processes, by process 0 only). A function building it runs on first read."""
        if timeline is None:
            return
        if not isinstance(timeline, Timeline):
            if not self._options.profile_dir:
                self._timeline_source, self._timeline = timeline, None
                return
            timeline = timeline()
        self._timeline_source, self._timeline = None, timeline
        if self._options.profile_dir and timeline.meta.get("gathered", True):
            from .viz.profile import write_profile

            write_profile(timeline, self._options.profile_dir, self)

    def _anchor_recorder(self, batching) -> Optional[anchors.AnchorRecorder]:
        wanted = self._options.anchored_tensors
        if not wanted or not self._training:
            return None
        names = {id(p): n for n, p in self._user_model.named_parameters()}
        return anchors.AnchorRecorder(wanted.values(), self._program.trainable, names,
                                      batching.factor, batching.device_iterations)

    # -- PopTorch's other wrapper methods: state, device, weights, anchors ------------
    def _compiled(self) -> Program:
        if self._program is None:
            raise ModelStateError(NOT_COMPILED)
        return self._program

    def getTensorNames(self) -> List[str]:
        """The tensors ``Options.anchorTensor`` can name for this model (see :mod:`ipukit.anchors`)."""
        self._compiled()
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
        if self._timeline_source is not None:  # built on first read
            self._timeline_source, self._timeline = None, self._timeline_source()
        return self._timeline

    def isCompiled(self) -> bool:
        return self._program is not None

    def isAttachedToDevice(self) -> bool:
        return self._program is not None and self._attached

    def detachFromDevice(self) -> None:
        """Release the virtual IPUs (the next call attaches again)."""
        self._compiled()
        if not self._attached:
            raise ModelStateError("Device is not attached: call attachToDevice() first, or just "
                                  "call the model, which attaches it.")
        self._attached = False

    def attachToDevice(self) -> None:
        self._compiled()
        if self._attached:
            raise ModelStateError("Device is already attached.")
        self._attached = True

    def copyWeightsToHost(self) -> None:
        """Weights are shared with the host module: nothing to copy in one process. With stages
        as processes, every process gets every stage's weights (a collective: call it on all)."""
        self._compiled()
        if self._options.Distributed.numProcesses > 1:
            from .runtime.processes import runtime as distributed

            distributed.synchronize_weights(self)

    def copyWeightsToDevice(self) -> None:
        """Copy the host module's parameters and buffers to the compiled model: they are shared, so
        in-place writes need no copy; one replaced by another tensor has its values copied back.
        """
        self._watch.copy_to_device(self._compiled(), None)

    def copyNamedBuffersToDevice(self) -> None:
        """:meth:`copyWeightsToDevice` for the buffers named in
        ``Options.updatableNamedBuffers`` (every buffer when the option is not set)."""
        program = self._compiled()
        names = compiler.updatable_buffers(self._options)
        self._watch.copy_to_device(program, ("Buffer", None if names is None else set(names)))

    def compilationTime(self) -> datetime.timedelta:
        """How long tracing and partitioning the model took (its "compilation")."""
        return datetime.timedelta(seconds=self._compiled().compile_seconds)

    def copyWeightsToHostIfNeeded(self) -> bool:
        return False

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` (e.g. with a new learning rate) from the next call on."""
        if not self._training:
            raise ModelStateError("setOptimizer(): an inference model has no optimizer.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptionsError(f"setOptimizer({optimizer!r}): expected a torch.optim.Optimizer.")
        _name_parameters(optimizer, self._user_model)
        self._optimizer = optimizer

    def destroy(self) -> None:
        """Forget the compiled model and unwrap the module; calling the wrapper again recompiles it with
        the same weights and optimiser, unless another training wrapper of the module exists.
        """
        self._destroyed = True
        self._program = None
        self.runtime_state.clear()
        self._attached = False
        if self._training and training_wrapper(self._user_model) is self:
            del _TRAINING_WRAPPERS[self._user_model]


def _own_copies(micro: List[list], mutated: Dict[int, torch.device]) -> None:
    """Each micro-batch gets its own copy of an input the model changes in place (on the
    device of the stage that reads it), for :func:`_write_back`."""
    for i, device in mutated.items():
        for row in micro:
            row[i] = row[i].to(device, copy=True)


def _write_back(callers: List[Any], micro: List[list], mutated: Dict[int, torch.device]) -> None:
    """Copy what the model wrote into its inputs back into the caller's tensors."""
    with torch.no_grad():
        for i in mutated:
            pieces = [row[i] for row in micro]
            callers[i].copy_(pieces[0] if len(pieces) == 1 else torch.cat(pieces))


def _host_change_message(kind: str, name: str, how: str) -> str:
    """A parameter or buffer the host replaced or removed after the model was compiled."""
    if how == "removed":
        return (f"{kind} {name} is removed from the model after it was compiled, but the "
                f"compiled model still holds it. Register it again, or call model.destroy() "
                "and call the model again to recompile without it.")
    fix = ("model.copyNamedBuffersToDevice() or model.copyWeightsToDevice()"
           if kind == "Buffer" else "model.copyWeightsToDevice()")
    return (f"{kind} {name} is reassigned within the model after it was compiled (another "
            "tensor was assigned to it, not written in place), so the compiled model would "
            f"still use the old one. Consider using self.{name}.copy_(src) to copy data from "
            f"a source tensor, or call {fix} to copy the new tensor's values into the "
            "compiled one.")


def _outputs(program: Program, rows: List[list], micro: List[list]):
    """The call's outputs, in the model's structure, per the output mode."""
    part = program.partition
    for j, ref in enumerate(part.outputs):
        if ref.kind == "const":
            for row in rows:
                row[j] = ref.value
        elif ref.kind == "input":
            for row, inputs in zip(rows, micro):
                row[j] = inputs[program.tensor_inputs[ref.index]]
    flat_out = microbatch.gather(rows, program.output_mode, program.output_period,
                                 program.batching)
    return pytree.tree_unflatten(flat_out, part.out_spec)


def _call_timeline(wrapper: "PoplarExecutor", runner, flat, t_call, t_run, t_gather):
    """A function building the call's timeline (the workers' spans and the host's before and
    after), so a call does not pay for a :class:`Timeline` nobody reads."""
    samples = next((v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    source = runner.timeline_source(samples)
    now = time.perf_counter()
    program = wrapper.program
    call, last = runner.call_index, program.batching.device_iterations - 1
    meta = {"model": wrapper.options.model_name or ("training" if wrapper.training
                                                    else "inference"),
            "stage_ipus": list(program.schedule.stage_ipus),
            "blocks": [st.blocks for st in program.partition.stages]}

    def build() -> Timeline:
        tl = source()
        tl.events.insert(0, Event(-1, "host", -1, 0.0, t_run - t_call, -1, 0, 0, call))
        tl.events.append(Event(-1, "host", -1, t_gather - t_call, now - t_call, -1, 0, last,
                               call))
        tl.meta.update(meta)
        return tl
    return build


def _warn_other_loader(flat, model: "PoplarExecutor") -> None:
    """A batch from an ipukit.DataLoader built for other Options changes the micro-batch size."""
    first = flat[0] if flat else None
    factor = getattr(first, "_ipukit_combined_factor", None)
    if factor is None or factor == model._batching().factor or model._loader_warned:
        return
    model._loader_warned = True
    warnings.warn(
        f"ipukit: this batch comes from an ipukit.DataLoader built for Options with "
        f"{factor} micro-batches per call, but the model's Options take "
        f"{model._batching().factor} (deviceIterations × replicationFactor × "
        "gradientAccumulation), so each micro-batch holds a different number of samples than "
        "the DataLoader's batch_size. Build the DataLoader with the model's options "
        "(model.options).", stacklevel=3)


# module -> its training wrapper (weakly on both sides). Kept out of the module's
# own attributes, so torch.save(module) and copy.deepcopy(module) work as usual.
_TRAINING_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def training_wrapper_set_aside(model: torch.nn.Module):
    """While inside, ``model`` counts as not wrapped for training (for a throw-away one)."""
    ref = _TRAINING_WRAPPERS.pop(model, None)
    try:
        yield
    finally:
        if ref is not None:
            _TRAINING_WRAPPERS[model] = ref


def training_wrapper(model: torch.nn.Module) -> Optional[PoplarExecutor]:
    """The live training model wrapping ``model``, if any."""
    ref = _TRAINING_WRAPPERS.get(model)
    return None if ref is None else ref()


# How many parameters, buffers and submodules torch has registered (assigned) anywhere since
# the first compile: a call checks its module's tensors in full only when this moved.
_REGISTRATIONS = [0]
_WATCHING: List[Any] = []


def _count_registration(*_args) -> None:
    _REGISTRATIONS[0] += 1


def _watch_registrations() -> None:
    """Count torch's parameter, buffer and module registrations (installed once)."""
    if _WATCHING:
        return
    from torch.nn.modules import module as nn_module

    _WATCHING.extend([nn_module.register_module_parameter_registration_hook(_count_registration),
                      nn_module.register_module_buffer_registration_hook(_count_registration),
                      nn_module.register_module_module_registration_hook(_count_registration)])


_PRE_COMPILE_HOOKS: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
_POST_COMPILE_HOOKS: "collections.OrderedDict[int, Any]" = collections.OrderedDict()


def _register(hooks: "collections.OrderedDict[int, Any]", hook,
              what: str) -> torch.utils.hooks.RemovableHandle:
    # Validate before the registry changes: a non-callable kept here would break every
    # later compile in the process.
    if not callable(hook):
        raise Error(f"{what} hook must be callable (got {hook!r} of type "
                    f"{type(hook).__name__}). Pass a function taking no arguments; "
                    "nothing was registered.")
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` before any model is compiled (traced); ``handle.remove()`` undoes it."""
    return _register(_PRE_COMPILE_HOOKS, hook, "Pre-compile")


def registerPostCompileHook(hook) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` after any model is compiled; ``handle.remove()`` undoes it."""
    return _register(_POST_COMPILE_HOOKS, hook, "Post-compile")


def _module_of(model, what: str) -> torch.nn.Module:
    model = model._user_model if isinstance(model, PoplarExecutor) else model
    if not isinstance(model, torch.nn.Module):
        raise OptionsError(f"{what}({model!r}): expected a torch.nn.Module.")
    return model


def trainingModel(model: torch.nn.Module, options: Optional[Options] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> PoplarExecutor:
    """Wrap ``model`` (which returns its loss) for training; PopTorch's ``trainingModel``.

    The default optimizer, as in PopTorch, is ``SGD(lr=0.01)``.
    """
    model = _module_of(model, "trainingModel")
    if training_wrapper(model) is not None:
        raise ModelStateError(ALREADY_WRAPPED)
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: torch.nn.Module, options: Optional[Options] = None) -> PoplarExecutor:
    """Wrap ``model`` for inference; PopTorch's ``inferenceModel``.

    It shares weights with any training model of the same module, so it sees the latest step.
    """
    return PoplarExecutor(_module_of(model, "inferenceModel"), options, training=False)


# -- PopTorch's custom argument parsers --------------------------------------------------

class ICustomArgParser(abc.ABC):
    """PopTorch's interface for a batch type of your own: how to find its tensors and how to
    rebuild it. Registered with :func:`registerCustomArgParser`, an argument of that type
    reaches ``forward`` rebuilt per micro-batch, its tensors split along dimension 0.
    """

    @abc.abstractmethod
    def yieldTensors(self, struct) -> Iterator[torch.Tensor]:
        """Yield every tensor of ``struct``, always in the same order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """A new object like ``original_structure`` holding the tensors of
        ``tensor_iterator``, taken in :meth:`yieldTensors`' order."""


_CUSTOM_ARG_PARSERS: Dict[type, ICustomArgParser] = {}
_FLATTENED_TYPES: set = set()  # the types told to torch's pytree (once each)


class _Parsed:
    """The pytree context of a custom-parsed argument: its template object and parser; two
    match when the type and the parser do (PopTorch compared only the tensors)."""

    __slots__ = ("cls", "parser", "template")

    def __init__(self, cls: type, parser: Optional[ICustomArgParser], template: Any) -> None:
        self.cls, self.parser, self.template = cls, parser, template

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Parsed) or other.cls is not self.cls \
                or other.parser is not self.parser:
            return False
        # no parser (unregistered since): the object is a value fixed at compile time
        return self.parser is not None or repr(self.template) == repr(other.template)

    def __hash__(self) -> int:
        return hash((self.cls, id(self.parser)))

    def __repr__(self) -> str:
        return f"{self.cls.__name__}(parsed by {type(self.parser).__name__})"


def _custom_tensors(obj) -> tuple:
    cls = type(obj)
    parser = _CUSTOM_ARG_PARSERS.get(cls)
    if parser is None:  # unregistered: no tensors, the object itself is the value
        return [], _Parsed(cls, None, obj)
    try:
        tensors = list(parser.yieldTensors(obj))
    except Exception as exc:  # noqa: BLE001 - the user's parser: re-raised, naming it
        raise Error(f"The custom argument parser {type(parser).__name__} registered for "
                    f"{cls.__name__} failed in yieldTensors: {type(exc).__name__}: {exc}. "
                    "Fix the parser (yield each tensor of the object), or unregister it "
                    f"with registerCustomArgParser({cls.__name__}, None).") from exc
    wrong = next((t for t in tensors if not isinstance(t, torch.Tensor)), None)
    if wrong is not None:
        raise Error(f"The custom argument parser {type(parser).__name__} registered for "
                    f"{cls.__name__} yielded a {type(wrong).__name__} from yieldTensors; "
                    "it must yield torch.Tensor objects only (other fields stay in the "
                    "object that reconstruct() receives).")
    return tensors, _Parsed(cls, parser, obj)


def _custom_rebuild(tensors, context: _Parsed):
    if context.parser is None:
        return context.template
    return context.parser.reconstruct(context.template, iter(list(tensors)))


def _custom_tensors_with_keys(obj) -> tuple:
    tensors, context = _custom_tensors(obj)
    return [(pytree.SequenceKey(i), t) for i, t in enumerate(tensors)], context


def registerCustomArgParser(arg_data_type: type, arg_parser: Optional[ICustomArgParser]) -> None:
    """Arguments of type ``arg_data_type`` are flattened into their tensors with ``arg_parser`` and
    rebuilt for ``forward``; ``arg_parser=None`` removes the parser. Raises ``OptionsError``
    (registering nothing) for a type or parser it cannot use.
    """
    if not isinstance(arg_data_type, type):
        raise OptionsError(
            f"registerCustomArgParser(arg_data_type={arg_data_type!r}): arg_data_type must be "
            f"a class (the type of your batch objects), not a {type(arg_data_type).__name__}; "
            "nothing was registered.")
    ours = arg_data_type in _FLATTENED_TYPES
    if issubclass(arg_data_type, torch.Tensor) or arg_data_type.__module__ == "builtins" or \
            (not ours and arg_data_type in pytree.SUPPORTED_NODES):
        raise OptionsError(
            f"registerCustomArgParser(arg_data_type={arg_data_type.__name__}): "
            "arg_data_type is a tensor, built-in or container type that ipukit already "
            "flattens itself; register parsers for your own batch classes only. Nothing was "
            "registered.")
    if arg_parser is None:
        _CUSTOM_ARG_PARSERS.pop(arg_data_type, None)
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise OptionsError(
            f"arg_parser must inherit from ICustomArgParser (registerCustomArgParser("
            f"{arg_data_type.__name__}, {arg_parser!r})): subclass ipukit.ICustomArgParser and "
            "implement yieldTensors and reconstruct; nothing was registered.")
    if not ours:
        pytree.register_pytree_node(
            arg_data_type, _custom_tensors, _custom_rebuild,
            serialized_type_name=f"ipukit.custom.{arg_data_type.__module__}."
                                 f"{arg_data_type.__qualname__}",
            flatten_with_keys_fn=_custom_tensors_with_keys)
        _FLATTENED_TYPES.add(arg_data_type)
    _CUSTOM_ARG_PARSERS[arg_data_type] = arg_parser
