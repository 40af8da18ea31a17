"""PyTorch Lightning's IPU front door on ipukit: ``IPUAccelerator``, ``IPUStrategy``, ``IPUPrecision``.

Lightning code written for Graphcore IPUs runs with one changed import. Importing this
module registers the accelerator ``"ipu"`` and the strategy ``"ipu_strategy"``, and
``Trainer(accelerator="ipu")`` picks :class:`IPUStrategy`. Every Lightning batch is one
ipukit call (docs/lightning.md maps each setting).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch

from .base import CLIPPING_MESSAGE, STAGE_KEY, LightningError, map_tensors
from .setup import TrainerSetup
from .steps import StepBridge
from ..core.options import Options

from pytorch_lightning.accelerators import Accelerator, AcceleratorRegistry
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import RunningStage, TrainerFn

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["IPUAccelerator", "IPUStrategy", "IPUPrecision", "LightningError"]


_AUTO_DEVICE_COUNT = 4   # lightning-graphcore's: "the minimal unit they are shipped in"


class _AutoCount(int):
    """``auto_device_count()``'s value: an int that remembers it was not asked for."""


class _AutoDevices(list):
    """``get_parallel_devices`` of an automatic count: the strategy's ``devices_auto``."""


class IPUAccelerator(Accelerator):
    """Lightning's ``"ipu"`` accelerator: ipukit's virtual IPUs.

    ``devices`` is the number of replicas (``Options.replicationFactor``); ``"auto"`` (and -1)
    is 4, as in lightning-graphcore, unless the strategy's options set the replication factor.
    """

    #: marks ipukit's IPU accelerator classes (kept by reloads of this module)
    ipukit_virtual_ipus = True

    def setup_device(self, device: torch.device) -> None:
        pass

    def get_device_stats(self, device) -> Dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        if isinstance(devices, _AutoCount):
            return devices
        if isinstance(devices, str) and devices.strip() in ("auto", "-1") or devices == -1:
            return IPUAccelerator.auto_device_count()
        if devices is None:
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
        chosen = [torch.device("cpu")] * int(devices)
        return _AutoDevices(chosen) if isinstance(devices, _AutoCount) else chosen

    @staticmethod
    def auto_device_count() -> int:
        """Replicas for ``devices="auto"``: 4, as lightning-graphcore."""
        return _AutoCount(_AUTO_DEVICE_COUNT)

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


_PRECISIONS = ("32-true", "16-mixed", "16-true")
_PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "16": "16-mixed",
                      "16-mixed": "16-mixed", "16-true": "16-true"}


def _unified_precision(precision) -> str:
    key = str(precision)
    if key not in _PRECISION_ALIASES:
        raise LightningError(
            f"`Trainer(accelerator='ipu', precision={precision!r})` is not supported. ipukit's "
            f"IPU strategy runs {list(_PRECISIONS)} (16 means '16-mixed'): use one of them, "
            "or another accelerator for this precision.")
    return _PRECISION_ALIASES[key]


class IPUPrecision(Precision):
    """Precision plugin of the IPU strategy: ipukit runs the backward pass and the step.

    ``"32-true"`` changes nothing; ``"16-true"`` converts the module to half (ipukit updates
    the weights in float32); ``"16-mixed"`` (``precision=16``) casts float inputs to half, as
    Lightning's IPU plugin did, and the model keeps its dtype. Float inputs are always cast to
    the model's floating dtype before a step, so a ``.half()`` model takes float32 batches.
    """

    def __init__(self, precision: Union[str, int] = "32-true") -> None:
        self.precision = _unified_precision(precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision == "16-true":
            return module.half()
        return module

    def convert_input(self, data: Any) -> Any:
        if self.precision in ("16-mixed", "16-true"):
            return map_tensors(data, lambda t: t.half() if t.is_floating_point() else t)
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
        raise LightningError(CLIPPING_MESSAGE.format(value=clip_val))


# a run's stage key, by the names users write
_STAGE_NAMES = {"train": "train", "training": "train", "fit": "train",
                "validate": "validate", "validation": "validate", "val": "validate",
                "sanity_check": "validate", "test": "test", "testing": "test",
                "predict": "predict", "predicting": "predict"}


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
    (or ``"validate"``, ``"test"``, ``"predict"``). The hooks delegate to ``_setup`` (a
    :class:`~ipukit.lightning.setup.TrainerSetup`: checks, options, data loaders) and
    ``_steps`` (a :class:`~ipukit.lightning.steps.StepBridge`: the models running the steps).
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
        self._setup = TrainerSetup(self, training_opts, inference_opts)
        self._steps = StepBridge(self, self._setup)
        self.device_iterations = device_iterations
        self.autoreport = bool(autoreport)
        self.autoreport_dir = autoreport_dir
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
    def device_count(self) -> int:
        """``Trainer(devices=...)`` as a count (1 before the strategy meets a Trainer)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def devices_auto(self) -> bool:
        """Whether ``devices`` was ``"auto"`` (then the user's options, if any, decide)."""
        return isinstance(self.parallel_devices, _AutoDevices)

    @property
    def replication_factor(self) -> int:
        """Replicas of the current run: the running stage's options' after setup, else
        lightning-graphcore's rule (:meth:`TrainerSetup.planned_replication_factor`)."""
        built = self._setup.opts
        if not built:
            return self._setup.planned_replication_factor()
        key = STAGE_KEY.get(self._running_stage())
        opts = built.get(key) or built.get("train") or built.get("validate")
        return opts.replication_factor

    def _running_stage(self) -> Optional[RunningStage]:
        module = self.lightning_module
        try:
            trainer = None if module is None else module.trainer
        except RuntimeError:  # the module is not attached to a Trainer
            trainer = None
        return None if trainer is None else trainer.state.stage

    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        """The precision's input cast only: ipukit moves each micro-batch inside the call."""
        return self.precision_plugin.convert_input(batch)

    @property
    def poptorch_models(self) -> Dict[RunningStage, Any]:
        """The ipukit model (``PoplarExecutor``) of each ``RunningStage`` of the current run, built at
        setup as in lightning-graphcore (keys also ``"train"``, ``"validate"``, ``"test"``,
        ``"predict"``).
        """
        return self._steps.poptorch_models

    # -- setup (delegated to TrainerSetup) ------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        self._setup.prepare(trainer, module)
        self._steps.start()
        super().setup(trainer)
        self._steps.build(_stages_of(trainer))
        self._steps.guard_logging(module)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning's, refusing several optimizers: an ipukit training model steps one."""
        count = None
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as exc:  # Lightning's own refusal of several optimizers
            if "multiple optimizers" not in str(exc):
                raise
            count = "more than one optimizer"
        if count is None and len(self.optimizers) > 1:
            count = f"{len(self.optimizers)} optimizers"
        if count is not None:
            raise LightningError(
                f"IPUs currently only support one optimizer. configure_optimizers() returned "
                f"{count}; an ipukit training model steps one optimiser inside each call. "
                "Return one optimizer (parameter groups give parts of the model their own "
                "settings).")

    @property
    def training_opts(self) -> Options:
        """The options of the training model (built at setup)."""
        return self._setup.opts.get("train") or self._setup.user_training_opts

    @property
    def inference_opts(self) -> Options:
        """The options of the validation model (built at setup)."""
        return self._setup.opts.get("validate") or self._setup.user_inference_opts

    def process_dataloader(self, dataloader: object) -> object:
        """Each loader becomes an ``ipukit.DataLoader``: a batch is one whole ipukit call."""
        return self._setup.process_dataloader(dataloader)

    # -- steps (delegated to StepBridge) --------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            return self._steps.run(RunningStage.TRAINING, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        stage = self.lightning_module.trainer.state.stage
        stage = RunningStage.VALIDATING if stage != RunningStage.SANITY_CHECKING else stage
        with self.precision_plugin.val_step_context():
            return self._steps.run(stage, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self._steps.run(RunningStage.TESTING, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self._steps.run(RunningStage.PREDICTING, args, kwargs)

    # -- timelines and reports -------------------------------------------------------------
    def timeline(self, stage: Union[str, RunningStage] = "train"):
        """The measured :class:`ipukit.Timeline` of the latest call of a run's model.

        ``stage``: ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``. None before any call.
        """
        key = STAGE_KEY.get(stage) if isinstance(stage, RunningStage) else \
            _STAGE_NAMES.get(str(stage).lower())
        if key is None:
            raise LightningError(f"timeline({stage!r}): use 'train', 'validate', 'test' or "
                                 "'predict'.")
        model = self._steps.last.get(key)
        return None if model is None else model.getTimeline()

    def model_for(self, stage: str = "train"):
        """The ipukit model (``PoplarExecutor``) that ran the latest ``stage`` run."""
        return self._steps.last.get(_STAGE_NAMES.get(str(stage).lower(), str(stage)))

    def _write_report(self, stage: str) -> None:
        if not self.autoreport:
            return
        model = self._steps.last.get(stage)
        tl = None if model is None else model.getTimeline()
        if tl is None:
            return
        from ..viz.profile import write_profile

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
        if module is not None:
            self._steps.unguard_logging(module)
        self._setup.restore()
        self._steps.release()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="ipukit's IPU strategy",
                                   override=True)


def _stages_of(trainer: "pl.Trainer") -> List[RunningStage]:
    """The stages a Trainer run will use (lightning-graphcore's ``poptorch_models`` keys)."""
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        stages = [RunningStage.TRAINING]
        if trainer.enable_validation:
            stages.append(RunningStage.VALIDATING)
            if trainer.num_sanity_val_steps > 0:
                stages.append(RunningStage.SANITY_CHECKING)
        return stages
    return {TrainerFn.VALIDATING: [RunningStage.VALIDATING],
            TrainerFn.TESTING: [RunningStage.TESTING],
            TrainerFn.PREDICTING: [RunningStage.PREDICTING]}.get(fn, [])


def _choose_ipu_strategy() -> None:
    """``Trainer(accelerator="ipu")`` without ``strategy=`` gets :class:`IPUStrategy`: Lightning has
    no public hook for it, so the connector's choice is wrapped (once, across reloads).
    """
    from pytorch_lightning.trainer.connectors import accelerator_connector as connector

    cls = connector._AcceleratorConnector
    current = cls._choose_strategy
    original = getattr(current, "_ipukit_original", current)

    def _choose_strategy(self):
        if getattr(getattr(self, "accelerator", None), "ipukit_virtual_ipus", False):
            return "ipu_strategy"
        return original(self)

    _choose_strategy._ipukit_original = original
    cls._choose_strategy = _choose_strategy


IPUAccelerator.register_accelerators(AcceleratorRegistry)
IPUStrategy.register_strategies(StrategyRegistry)
_choose_ipu_strategy()
