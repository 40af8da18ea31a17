"""PyTorch Lightning's IPU front door, on ipukit: ``IPUAccelerator``, ``IPUStrategy``, ``IPUPrecision``.

Lightning code written for Graphcore IPUs (``Trainer(accelerator="ipu", devices=8,
strategy=IPUStrategy(device_iterations=32))``) runs here with one changed import::

    from ipukit.lightning import IPUStrategy       # was: from lightning_graphcore import IPUStrategy
    import ipukit as poptorch                      # was: import poptorch

Importing this module registers the accelerator ``"ipu"`` and the strategy
``"ipu_strategy"`` with pytorch-lightning (pinned to 2.6.6, the ``ipukit[lightning]``
extra), and makes ``Trainer(accelerator="ipu")`` pick :class:`IPUStrategy` when no
strategy is given.

How a Lightning run maps onto ipukit:

* every Lightning batch is one ipukit call: the strategy turns each dataloader into an
  :class:`ipukit.DataLoader`, whose batches hold micro-batch × device iterations ×
  gradient accumulation × replicas samples (a user's own ``ipukit.DataLoader`` is kept);
* ``training_step`` runs inside ``ipukit.trainingModel`` (one per fit), the other steps
  inside ``ipukit.inferenceModel`` s; all share the LightningModule's weights, so
  validation during fit sees every optimiser step;
* ``devices`` is the replication factor, ``accumulate_grad_batches`` the gradient
  accumulation; ``Block``/``BeginBlock`` annotations split the model into pipeline stages
  as in any ipukit model;
* Lightning's ``global_step`` counts optimiser steps: a call with ``device_iterations=N``
  advances it by N, and schedulers with ``interval="step"`` step N times after it.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Union

import torch

from . import blocks as _blocks
from .data import DataLoader as _IpuDataLoader
from .errors import Error, PipelineConfigError
from .model import inferenceModel, trainingModel
from .ops import identity_loss
from .options import Options

try:
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators import Accelerator, AcceleratorRegistry
    from pytorch_lightning.callbacks import GradientAccumulationScheduler
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
    from pytorch_lightning.trainer.states import RunningStage, TrainerFn
    from pytorch_lightning.utilities.model_helpers import is_overridden
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ipukit.lightning needs pytorch-lightning 2.6.6: pip install 'ipukit[lightning]' "
        f"(or pip install pytorch-lightning==2.6.6). ({exc})") from exc

__all__ = ["IPUAccelerator", "IPUStrategy", "IPUPrecision", "LightningError"]


class LightningError(Error, ValueError):
    """A Lightning setting or LightningModule feature that ipukit's IPU strategy cannot run."""


# --------------------------------------------------------------------------- accelerator
class IPUAccelerator(Accelerator):
    """Lightning's ``"ipu"`` accelerator: ipukit's virtual IPUs (worker threads).

    ``devices`` is the number of replicas (``Options.replicationFactor``); ``"auto"`` is 1.
    The torch device of each virtual IPU follows ipukit (CUDA when present, else CPU, or
    ``Options.deviceMapping``).
    """

    def setup_device(self, device: torch.device) -> None:
        pass

    def get_device_stats(self, device) -> Dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        if devices in ("auto", -1, "-1", None):
            return 1
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, (list, tuple)):
            devices = len(devices)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise LightningError(
                f"Trainer(accelerator='ipu', devices={devices!r}): devices is the number of "
                "replicas (ipukit.Options().replicationFactor); give an int >= 1 or 'auto' (1).")
        return devices

    @staticmethod
    def get_parallel_devices(devices: int) -> List[torch.device]:
        return [torch.device("cpu")] * int(devices)

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True  # virtual IPUs always exist

    @staticmethod
    def name() -> str:
        return "ipu"

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register("ipu", cls, description="ipukit's virtual IPUs",
                                      override=True)


# --------------------------------------------------------------------------- precision
_PRECISIONS = ("32-true", "16-mixed", "16-true")
_PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "16": "16-mixed",
                      "16-mixed": "16-mixed", "16-true": "16-true"}


def _unified_precision(precision) -> str:
    key = str(precision)
    if key not in _PRECISION_ALIASES:
        raise LightningError(
            f"Trainer(accelerator='ipu', precision={precision!r}) is not supported: use one of "
            f"{list(_PRECISIONS)} (16 means '16-mixed').")
    return _PRECISION_ALIASES[key]


class IPUPrecision(Precision):
    """Precision plugin of the IPU strategy: ipukit runs the backward pass and the step.

    * ``"32-true"``: nothing changes.
    * ``"16-true"``: the LightningModule is converted to half precision; ipukit accumulates its
      gradients and updates its weights in float32 (PopTorch's optimisers), then rounds back.
    * ``"16-mixed"`` (``precision=16``): as Lightning's IPU plugin did, float inputs are cast to
      half precision; the model keeps its dtype and, as PopTorch 3's default
      (``HalfFloatCastingBehavior.HalfUpcastToFloat``), computes a float32 model on those
      half-rounded inputs. Call ``model.half()`` yourself for half-precision compute.

    Float inputs are always cast to the model's floating dtype before a step (PopTorch cast
    float inputs for half models), so a ``.half()`` model takes float32 batches.
    """

    def __init__(self, precision: Union[str, int] = "32-true") -> None:
        self.precision = _unified_precision(precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision == "16-true":
            return module.half()
        return module

    def convert_input(self, data: Any) -> Any:
        if self.precision in ("16-mixed", "16-true"):
            return _map_tensors(data, lambda t: t.half() if t.is_floating_point() else t)
        return data

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        """ipukit computed the gradients inside the step: nothing to do here."""

    def optimizer_step(self, optimizer, model, closure, **kwargs) -> Any:
        """ipukit stepped the optimiser inside the step: run the closure (the step) only."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise LightningError("torch.optim.LBFGS needs its closure re-evaluated within one "
                                 "step, which ipukit's compiled steps cannot do; use another "
                                 "optimizer in configure_optimizers().")
        result = closure()
        self._after_closure(model, optimizer)
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        if clip_val is None or clip_val <= 0:
            return
        raise LightningError(_CLIPPING_MESSAGE.format(value=clip_val))


_ONE_OPTIMIZER = (
    "configure_optimizers() returned {count}; an ipukit training model steps one "
    "optimiser inside each call. Return one optimizer (parameter groups give parts of the model "
    "their own settings).")

_CLIPPING_MESSAGE = (
    "Trainer(gradient_clip_val={value!r}): ipukit steps the optimiser inside the model call, so "
    "Lightning cannot clip the gradients in between. Remove gradient_clip_val and clip in the "
    "optimiser instead: return e.g. ipukit.optim.AdamW(self.parameters(), lr=..., "
    "max_grad_norm=1.0) from configure_optimizers() (PopTorch's optimisers clip the global "
    "gradient norm).")


def _map_tensors(data: Any, fn) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*[_map_tensors(v, fn) for v in data])
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(v, fn) for v in data)
    if isinstance(data, dict):
        return type(data)((k, _map_tensors(v, fn)) for k, v in data.items())
    return data


def _state_to_parameter_devices(optimizer) -> None:
    """Optimiser state next to its parameter, wherever ipukit placed the stage.

    Lightning restores a checkpoint's optimiser state onto the strategy's root device (the
    host); ipukit then moves each stage's weights to its virtual IPU's device. Scalars
    (Adam's ``step``) stay where torch.optim wants them.
    """
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device != p.device:
                state[key] = value.to(p.device)


# --------------------------------------------------------------------------- step module
_STEP_OF = {RunningStage.TRAINING: "training_step", RunningStage.SANITY_CHECKING: "validation_step",
            RunningStage.VALIDATING: "validation_step", RunningStage.TESTING: "test_step",
            RunningStage.PREDICTING: "predict_step"}
_BATCH_END_HOOK = {"training_step": "on_train_batch_end",
                   "validation_step": "on_validation_batch_end",
                   "test_step": "on_test_batch_end", "predict_step": "on_predict_batch_end"}

_log_state = threading.local()
_log_lock = threading.RLock()


class _StepModule(torch.nn.Module):
    """The module ipukit wraps: its forward is one of the LightningModule's ``*_step`` methods.

    Python arguments of the step (``batch_idx``, ``dataloader_idx``) are held as attributes,
    so only the batch is an input: as in PopTorch, a traced (multi-stage) step sees their
    values of its first call; a single-stage step runs eagerly and sees the current ones.
    """

    def __init__(self, module: "pl.LightningModule", step: str) -> None:
        super().__init__()
        self.module = module
        self.step = step
        self.extra_args: tuple = ()

    def forward(self, batch):
        rec = _blocks._active()
        if rec is not None:
            _keep_last_block_open(rec)
        out = getattr(self.module, self.step)(batch, *self.extra_args)
        if self.step != "training_step":
            return out
        if isinstance(out, torch.Tensor):
            return identity_loss(out, reduction="none")
        if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
            out = dict(out)
            out["loss"] = identity_loss(out["loss"], reduction="none")
            return out
        raise LightningError(
            "training_step must return the loss tensor or a dict with a 'loss' tensor when it "
            f"runs on ipukit (got {type(out).__name__}); skipping a step by returning None is "
            "not possible inside a compiled step.")


def _keep_last_block_open(rec) -> None:
    """Operations after the last ``with Block`` closed stay on that block's IPU.

    Lightning computes the loss in ``training_step`` after ``forward`` (whose blocks have
    closed), and the Lightning IPU docs' Blocks-in-``forward`` pattern relies on those
    operations running on the IPU of the block before them. ipukit's core refuses operations
    outside any block once a block closed; for Lightning steps they join the last block
    (done by wrapping the trace's block recorder, the only core internal used here).
    """
    if getattr(rec, "_ipukit_lightning", False):
        return
    rec._ipukit_lightning = True
    pop = rec.pop

    def pop_and_stay():
        pop()
        if not rec._stack and rec.segments:
            rec.in_block = True
            rec.closed_a_block = False

    rec.pop = pop_and_stay


def _guard_logging(module: "pl.LightningModule") -> Dict[str, Any]:
    """Wrap ``module.log``/``log_dict``: a no-op while ipukit traces the step (calls are
    noted, see ``IPUStrategy._compile``); otherwise one thread at a time (replicas)."""
    originals = {}
    for name in ("log", "log_dict"):
        original = getattr(module, name)
        originals[name] = module.__dict__.get(name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            if _blocks._active() is not None:
                noted = getattr(_log_state, "calls", None)
                if noted is not None:
                    first = args[0] if args else kwargs.get("name", kwargs.get("dictionary"))
                    noted.append((_name, first if isinstance(first, str) else None))
                return None
            with _log_lock:
                return _original(*args, **kwargs)

        module.__dict__[name] = guarded
    return originals


def _unguard_logging(module, originals: Dict[str, Any]) -> None:
    for name, original in originals.items():
        if original is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = original


# --------------------------------------------------------------------------- strategy
_STAGE_NAMES = {"train": "train", "training": "train", "fit": "train",
                "validate": "validate", "validation": "validate", "val": "validate",
                "sanity_check": "validate", "test": "test", "testing": "test",
                "predict": "predict", "predicting": "predict"}
_STAGE_KEY = {RunningStage.TRAINING: "train", RunningStage.SANITY_CHECKING: "validate",
              RunningStage.VALIDATING: "validate", RunningStage.TESTING: "test",
              RunningStage.PREDICTING: "predict"}


class IPUStrategy(ParallelStrategy):
    """Run a LightningModule on ipukit's virtual IPUs (lightning-graphcore's ``IPUStrategy``).

    Args:
        device_iterations: iterations (optimiser steps in training) per ipukit call.
        autoreport: write ipukit's profile (Chrome trace + HTML report with the per-IPU
            timeline, utilisation and memory) of the last call of each training, validation,
            test and predict run — PopVision's auto-report, for ipukit.
        autoreport_dir: where to write them (default ``./ipukit-autoreport``).
        training_opts: ``ipukit.Options`` for the training model (replace the defaults built
            from ``device_iterations``, ``devices`` and ``accumulate_grad_batches``).
        inference_opts: ``ipukit.Options`` for validation, test and predict models.

    The measured timeline of each kind of run is ``trainer.strategy.timeline("train")``
    (or ``"validate"``, ``"test"``, ``"predict"``).
    """

    strategy_name = "ipu_strategy"

    def __init__(self, accelerator: Optional[Accelerator] = None, device_iterations: int = 1,
                 autoreport: bool = False, autoreport_dir: Optional[str] = None,
                 parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment=None, checkpoint_io=None,
                 precision_plugin: Optional[Precision] = None,
                 training_opts: Optional[Options] = None,
                 inference_opts: Optional[Options] = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if (isinstance(device_iterations, bool) or not isinstance(device_iterations, int)
                or device_iterations < 1):
            raise LightningError(f"IPUStrategy(device_iterations={device_iterations!r}): expected "
                                 "an int >= 1 (iterations per ipukit call).")
        for name, opts in (("training_opts", training_opts), ("inference_opts", inference_opts)):
            if opts is not None and not isinstance(opts, Options):
                raise LightningError(f"IPUStrategy({name}={opts!r}): expected ipukit.Options() "
                                     "(poptorch.Options with `import ipukit as poptorch`).")
        self.device_iterations = device_iterations
        self.autoreport = bool(autoreport)
        self.autoreport_dir = autoreport_dir
        self._user_training_opts = training_opts
        self._user_inference_opts = inference_opts
        self._opts: Dict[str, Options] = {}
        self._models: Dict[tuple, Any] = {}
        self._last: Dict[str, Any] = {}       # stage key -> its latest ipukit model (kept after teardown)
        self._gradient_accumulation = 1
        self._saved_accumulation: Optional[int] = None
        self._log_originals: Optional[Dict[str, Any]] = None
        self.reports: List[Dict[str, str]] = []

    # -- Lightning plumbing ---------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else IPUPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # the Trainer builds its plugin from precision=...; ipukit runs backward and step itself
        if plugin is not None and not isinstance(plugin, IPUPrecision):
            plugin = IPUPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def model_to_device(self) -> None:
        pass  # ipukit places each stage on its virtual IPU's device

    @property
    def is_distributed(self) -> bool:
        return False  # replicas are threads of this process: no DistributedSampler

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @property
    def is_global_zero(self) -> bool:
        return True

    def reduce(self, tensor, *args, **kwargs):
        return tensor

    def barrier(self, *args, **kwargs) -> None:
        pass

    def broadcast(self, obj, src: int = 0):
        return obj

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    @property
    def replication_factor(self) -> int:
        """Replicas: ``devices`` (or the user's options' replicationFactor)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    # -- setup -------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        self._check_setup(trainer, module)
        self._gradient_accumulation = int(trainer.accumulate_grad_batches)
        self._opts = {}
        self._models = {}
        if trainer.state.fn == TrainerFn.FITTING:
            self._opts["train"] = self._options("train", trainer)
        for stage in ("validate", "test", "predict"):
            self._opts[stage] = self._options(stage, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_max_steps(trainer)
            # one Lightning batch is a whole ipukit call, accumulation included
            self._saved_accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = 1
        super().setup(trainer)
        self._log_originals = _guard_logging(module)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as exc:  # Lightning's own refusal of several optimizers
            if "multiple optimizers" not in str(exc):
                raise
            raise LightningError(_ONE_OPTIMIZER.format(count="more than one optimizer")) from None
        if len(self.optimizers) > 1:
            raise LightningError(_ONE_OPTIMIZER.format(count=f"{len(self.optimizers)} optimizers"))

    def _check_setup(self, trainer, module) -> None:
        for hook in ("transfer_batch_to_device", "on_after_batch_transfer"):
            if is_overridden(hook, module):
                raise LightningError(
                    f"{type(module).__name__}.{hook} is overridden, but on ipukit the batch "
                    "goes to the virtual IPUs inside the model call, so the hook would never "
                    "see it there. Remove the override; prepare batches in the dataset, the "
                    "collate_fn or on_before_batch_transfer instead.")
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not module.automatic_optimization:
            raise LightningError(
                f"{type(module).__name__}.automatic_optimization is False: ipukit runs the "
                "backward pass and the optimiser step inside the model call, so manual "
                "optimisation cannot work. Use automatic optimisation (return the loss from "
                "training_step).")
        if trainer.gradient_clip_val is not None and trainer.gradient_clip_val > 0:
            raise LightningError(_CLIPPING_MESSAGE.format(value=trainer.gradient_clip_val))
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise LightningError(
                "GradientAccumulationScheduler changes accumulate_grad_batches during training, "
                "but an ipukit training model is compiled for one gradientAccumulation. Use a "
                "fixed Trainer(accumulate_grad_batches=N).")

    def _check_max_steps(self, trainer) -> None:
        di = self._opts["train"].device_iterations
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps > 0 and max_steps % di:
            raise LightningError(
                f"Trainer(max_steps={max_steps}) is not a multiple of device_iterations ({di}): "
                f"each ipukit call makes {di} optimiser steps, so training would stop at "
                f"{-(-max_steps // di) * di}. Set max_steps to a multiple of {di}.")

    def _options(self, stage: str, trainer) -> Options:
        training = stage == "train"
        user = self._user_training_opts if training else self._user_inference_opts
        ga = int(trainer.accumulate_grad_batches) if training else 1
        replicas = self.replication_factor
        if user is None:
            opts = Options().deviceIterations(self.device_iterations)
            if replicas > 1:
                opts.replicationFactor(replicas)
            if training and ga > 1:
                opts.Training.gradientAccumulation(ga)
            seed = os.environ.get("PL_GLOBAL_SEED")
            if seed is not None:
                opts.randomSeed(int(seed))
        else:
            opts = user.clone()
            which = "training_opts" if training else "inference_opts"
            if replicas > 1 and opts.replication_factor != replicas:
                if opts.replication_factor != 1:
                    raise LightningError(
                        f"Trainer(devices={replicas}) and IPUStrategy({which}) with "
                        f"replicationFactor({opts.replication_factor}) disagree; devices is the "
                        "replication factor. Set one of them only, or both to the same value.")
                opts.replicationFactor(replicas)
            if training and ga > 1 and opts.Training.gradient_accumulation != ga:
                if opts.Training.gradient_accumulation != 1:
                    raise LightningError(
                        f"Trainer(accumulate_grad_batches={ga}) and IPUStrategy(training_opts) "
                        f"with Training.gradientAccumulation({opts.Training.gradient_accumulation}) "
                        "disagree. Set one of them only, or both to the same value.")
                opts.Training.gradientAccumulation(ga)
        if not opts.model_name:
            opts.modelName({"train": "training", "validate": "validation"}.get(stage, stage))
        return opts

    @property
    def training_opts(self) -> Options:
        """The options of the training model (built at setup)."""
        return self._opts.get("train") or self._user_training_opts

    @property
    def inference_opts(self) -> Options:
        """The options of the validation model (built at setup)."""
        return self._opts.get("validate") or self._user_inference_opts

    # -- data --------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """Each loader becomes an ``ipukit.DataLoader``: a batch is one whole ipukit call."""
        if isinstance(dataloader, _IpuDataLoader):
            return dataloader
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        stage = _STAGE_KEY.get(trainer.state.stage, "validate")
        opts = self._opts.get(stage) or self._opts.get("validate")
        batch_size, sampler = dataloader.batch_size, dataloader.sampler
        inner = getattr(dataloader.batch_sampler, "_batch_sampler", None)
        if batch_size is None and type(inner) is torch.utils.data.BatchSampler:
            # Lightning's own wrapper (predict) around a plain BatchSampler
            batch_size, sampler = inner.batch_size, inner.sampler
        if batch_size is None:  # a batch_sampler decides the batches
            if opts.replication_factor > 1:
                raise LightningError(
                    f"A DataLoader with a batch_sampler ({type(dataloader.batch_sampler).__name__}) "
                    f"cannot feed {opts.replication_factor} replicas: ipukit splits each batch "
                    "evenly between replicas and micro-batches. Use batch_size=... (and a "
                    "sampler) instead, or devices=1.")
            if opts.combined_batch_factor > 1:
                raise LightningError(
                    f"A DataLoader with a batch_sampler cannot be combined with device "
                    f"iterations or gradient accumulation (each batch would have to hold "
                    f"{opts.combined_batch_factor} micro-batches). Use batch_size=... instead.")
            return dataloader
        shuffle = isinstance(sampler, torch.utils.data.RandomSampler)
        kwargs = dict(num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                      pin_memory=dataloader.pin_memory, worker_init_fn=dataloader.worker_init_fn,
                      timeout=dataloader.timeout)
        if dataloader.num_workers > 0:
            kwargs["persistent_workers"] = dataloader.persistent_workers
        if shuffle:
            kwargs["generator"] = getattr(sampler, "generator", None)
        elif not isinstance(sampler, torch.utils.data.SequentialSampler):
            kwargs["sampler"] = sampler
        return _IpuDataLoader(opts, dataloader.dataset, batch_size=batch_size,
                              shuffle=shuffle, drop_last=True, **kwargs)

    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        return batch  # ipukit moves each micro-batch to its virtual IPU's device

    # -- steps -------------------------------------------------------------------------
    def _model_for(self, stage: RunningStage, dataloader_idx: int):
        step = _STEP_OF[stage]
        key = (step, dataloader_idx)
        model = self._models.get(key)
        if model is None:
            wrapper = _StepModule(self.lightning_module, step)
            stage_key = _STAGE_KEY[stage]
            if step == "training_step":
                model = trainingModel(wrapper, self._opts["train"], optimizer=self.optimizers[0])
            else:
                model = inferenceModel(wrapper, self._opts[stage_key])
            self._models[key] = model
        self._last[_STAGE_KEY[stage]] = model
        return model

    def _run(self, stage: RunningStage, args, kwargs) -> Any:
        if not args:
            raise LightningError("ipukit's IPU strategy expects the batch as the first argument "
                                 "of the step.")
        batch, extra = args[0], tuple(args[1:]) + tuple(kwargs.values())
        dataloader_idx = extra[1] if len(extra) > 1 and isinstance(extra[1], int) else 0
        model = self._model_for(stage, dataloader_idx)
        model.model.extra_args = extra
        batch = self._cast_inputs(batch)
        if not model.isCompiled():
            self._compile(model, batch)
            if model.training:
                _state_to_parameter_devices(model._optimizer)
        return model(batch)

    def _cast_inputs(self, batch: Any) -> Any:
        """Float inputs take the model's floating dtype (PopTorch cast inputs of half models)."""
        dtype = next((p.dtype for p in self.lightning_module.parameters()
                      if p.is_floating_point()), None)
        if dtype is None:
            return batch
        return _map_tensors(batch, lambda t: t.to(dtype)
                            if t.is_floating_point() and t.dtype != dtype else t)

    def _compile(self, model, batch) -> None:
        # A model compiled earlier (training, say) may have put the shared weights on a GPU;
        # ipukit traces on the sample it is given, so give it one on the weights' device.
        device = next((p.device for p in self.lightning_module.parameters()), None)
        if device is not None and device.type != "cpu":
            batch = _map_tensors(batch, lambda t: t.to(device))
        _log_state.calls = []
        try:
            model.compile(batch)
        except PipelineConfigError as exc:
            hint = (" With Lightning, Trainer(accumulate_grad_batches=N) sets the gradient "
                    "accumulation and IPUStrategy(device_iterations=N) the device iterations.")
            raise PipelineConfigError(str(exc) + hint) from None
        finally:
            calls, _log_state.calls = _log_state.calls, None
        stages = model.program.partition.num_stages
        if calls and stages > 1:
            step = model.model.step
            names = ", ".join(sorted({repr(n) for _, n in calls if n})) or "values"
            model.destroy()
            self._models = {k: v for k, v in self._models.items() if v is not model}
            raise LightningError(
                f"{type(self.lightning_module).__name__}.{step} calls self.log ({names}), but "
                f"ipukit traced it into {stages} pipeline stages: a traced step runs on the "
                "virtual IPUs and cannot call back into Lightning. Return the values instead "
                "(e.g. return {'loss': loss, 'acc': acc}) and log them in "
                f"{_BATCH_END_HOOK[step]}(self, outputs, batch, batch_idx), e.g. "
                "self.log('acc', outputs['acc']).")

    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            out = self._run(RunningStage.TRAINING, args, kwargs)
        self._account_steps()
        return out

    def validation_step(self, *args: Any, **kwargs: Any):
        stage = self.lightning_module.trainer.state.stage
        stage = RunningStage.VALIDATING if stage != RunningStage.SANITY_CHECKING else stage
        with self.precision_plugin.val_step_context():
            return self._run(stage, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self._run(RunningStage.TESTING, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self._run(RunningStage.PREDICTING, args, kwargs)

    def _account_steps(self) -> None:
        """A call with N device iterations made N optimiser steps; Lightning counts one."""
        extra = self._opts["train"].device_iterations - 1
        if extra <= 0:
            return
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        progress.optimizer.step.increment_by(extra)
        module = self.lightning_module
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            if config.frequency != 1:
                raise LightningError(
                    f"An lr scheduler with interval='step' and frequency={config.frequency} "
                    f"cannot follow optimiser steps made {extra + 1} at a time "
                    "(device_iterations); use frequency=1 or device_iterations=1.")
            for _ in range(extra):
                module.lr_scheduler_step(config.scheduler, None)

    # -- timelines and reports -------------------------------------------------------------
    def timeline(self, stage: Union[str, RunningStage] = "train"):
        """The measured :class:`ipukit.Timeline` of the latest call of a run's model.

        ``stage``: ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``. None before any call.
        """
        key = _STAGE_KEY.get(stage) if isinstance(stage, RunningStage) else \
            _STAGE_NAMES.get(str(stage).lower())
        if key is None:
            raise LightningError(f"timeline({stage!r}): use 'train', 'validate', 'test' or "
                                 "'predict'.")
        model = self._last.get(key)
        return None if model is None else model.getTimeline()

    def model_for(self, stage: str = "train"):
        """The ipukit model (``PoplarExecutor``) that ran the latest ``stage`` run."""
        return self._last.get(_STAGE_NAMES.get(str(stage).lower(), str(stage)))

    def _write_report(self, stage: str) -> None:
        if not self.autoreport:
            return
        model = self._last.get(stage)
        tl = None if model is None else model.getTimeline()
        if tl is None:
            return
        from .profile import write_profile

        directory = self.autoreport_dir or os.path.join(os.getcwd(), "ipukit-autoreport")
        self.reports.append(write_profile(tl, directory, model))

    def on_train_end(self) -> None:
        self._write_report("train")

    def on_validation_end(self) -> None:
        self._write_report("validate")

    def on_test_end(self) -> None:
        self._write_report("test")

    def on_predict_end(self) -> None:
        self._write_report("predict")

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._log_originals is not None:
            _unguard_logging(module, self._log_originals)
            self._log_originals = None
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if self._saved_accumulation is not None and trainer is not None:
            trainer.accumulate_grad_batches = self._saved_accumulation
        self._saved_accumulation = None
        for model in self._models.values():
            if model.training:
                model.destroy()  # unwrap: the module can be trained again
        self._models = {}
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="ipukit's IPU strategy",
                                   override=True)


# --------------------------------------------------------------------------- registration
def _choose_ipu_strategy() -> None:
    """``Trainer(accelerator="ipu")`` without ``strategy=`` gets :class:`IPUStrategy`.

    Lightning 2.x has no public hook for an accelerator's default strategy (1.x chose the IPU
    strategy itself), so the connector's choice is wrapped for the IPU accelerator only.
    """
    from pytorch_lightning.trainer.connectors import accelerator_connector as connector

    cls = connector._AcceleratorConnector
    if getattr(cls._choose_strategy, "_ipukit", False):
        return
    original = cls._choose_strategy

    def _choose_strategy(self):
        if isinstance(getattr(self, "accelerator", None), IPUAccelerator):
            return IPUStrategy.strategy_name
        return original(self)

    _choose_strategy._ipukit = True
    cls._choose_strategy = _choose_strategy


IPUAccelerator.register_accelerators(AcceleratorRegistry)
IPUStrategy.register_strategies(StrategyRegistry)
_choose_ipu_strategy()
