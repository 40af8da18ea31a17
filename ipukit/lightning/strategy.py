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
* one Lightning training step is one ipukit call, as in lightning-graphcore: ``global_step``,
  ``max_steps`` and ``interval="step"`` schedulers count calls; a call with
  ``device_iterations=N`` makes N optimiser steps (all at the learning rate the optimiser had
  when the call began, as PopTorch's did);
* ``devices="auto"`` is 4 replicas (``IPUAccelerator.auto_device_count()``, as
  lightning-graphcore), or the user's options' ``replicationFactor`` when options are given.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch

from .base import CLIPPING_MESSAGE, STAGE_KEY, LightningError, map_tensors
from .setup import TrainerSetup
from .steps import StepBridge
from ..core.options import Options

# after .base, which reports a missing pytorch-lightning with the install command
from pytorch_lightning.accelerators import Accelerator, AcceleratorRegistry
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import RunningStage, TrainerFn

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["IPUAccelerator", "IPUStrategy", "IPUPrecision", "LightningError"]


# --------------------------------------------------------------------------- accelerator
_AUTO_DEVICE_COUNT = 4   # lightning-graphcore's: "the minimal unit they are shipped in"


class _AutoCount(int):
    """``auto_device_count()``'s value: an int that remembers it was not asked for."""


class _AutoDevices(list):
    """``get_parallel_devices`` of an automatic count: the strategy's ``devices_auto``."""


class IPUAccelerator(Accelerator):
    """Lightning's ``"ipu"`` accelerator: ipukit's virtual IPUs (worker threads).

    ``devices`` is the number of replicas (``Options.replicationFactor``); ``"auto"`` (and -1)
    is :meth:`auto_device_count`, 4 as in lightning-graphcore, unless the strategy's options
    set the replication factor. The torch device of each virtual IPU follows ipukit (CUDA
    when present, else CPU, or ``Options.deviceMapping``).
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


# --------------------------------------------------------------------------- precision
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

    * ``"32-true"``: nothing changes.
    * ``"16-true"``: the LightningModule is converted to half precision; ipukit accumulates its
      gradients and updates its weights in float32 (PopTorch's optimisers), then rounds back.
    * ``"16-mixed"`` (``precision=16``): as Lightning's IPU plugin did, float inputs are cast to
      half precision (``strategy.batch_to_device``: float32 and float64 become float16, other
      dtypes stay); the model keeps its dtype and, as PopTorch 3's default
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


# --------------------------------------------------------------------------- strategy
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
    (or ``"validate"``, ``"test"``, ``"predict"``).

    This class holds Lightning's plumbing (devices, precision plugin, collectives of a
    single process), every Lightning hook, the timelines and reports; its hooks delegate
    to two collaborators it creates: ``_setup``, a
    :class:`~ipukit.lightning.setup.TrainerSetup` (checks, options, data loaders), and
    ``_steps``, a :class:`~ipukit.lightning.steps.StepBridge` (the ipukit models that run
    the ``*_step`` methods).
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
        """Replicas of the current run (lightning-graphcore's rule).

        After setup, the replication factor of the options of the running stage (training,
        or validation/test/predict). Before, the user's options' ``replicationFactor``
        (training options first) when given, else ``devices``; ``devices`` given explicitly
        also fills in options left at one replica.
        """
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
        """The precision's input cast only (``"16-mixed"``: float tensors to float16).

        ipukit moves each micro-batch to its virtual IPU's device inside the call.
        """
        return self.precision_plugin.convert_input(batch)

    @property
    def poptorch_models(self) -> Dict[RunningStage, Any]:
        """The ipukit model (``PoplarExecutor``) of each stage of the current Trainer run.

        Built at setup, as lightning-graphcore: ``fit`` gives ``RunningStage.TRAINING`` and,
        when it validates, ``VALIDATING`` (and ``SANITY_CHECKING``, the same model);
        ``validate``/``test``/``predict`` give their stage. Keys are Lightning's
        ``RunningStage`` and also answer to ``"train"``, ``"validate"``, ``"test"``,
        ``"predict"``. Extra dataloaders (``dataloader_idx`` > 0) get their own models,
        which are not listed here. Models compile at their first batch.
        """
        return self._steps.poptorch_models

    # -- setup (delegated to TrainerSetup) ------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        self._setup.prepare(trainer, module)
        self._steps.start()
        super().setup(trainer)
        self._steps.build(trainer.state.fn == TrainerFn.FITTING, _stages_of(trainer))
        self._steps.guard_logging(module)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        with self._setup.one_optimizer():
            super().setup_optimizers(trainer)
        self._setup.check_optimizers(self.optimizers)

    @property
    def training_opts(self) -> Options:
        """The options of the training model (built at setup)."""
        return self._setup.training_opts

    @property
    def inference_opts(self) -> Options:
        """The options of the validation model (built at setup)."""
        return self._setup.inference_opts

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
        model = self._steps.latest(key)
        return None if model is None else model.getTimeline()

    def model_for(self, stage: str = "train"):
        """The ipukit model (``PoplarExecutor``) that ran the latest ``stage`` run."""
        return self._steps.latest(_STAGE_NAMES.get(str(stage).lower(), str(stage)))

    def _write_report(self, stage: str) -> None:
        if not self.autoreport:
            return
        model = self._steps.latest(stage)
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


# --------------------------------------------------------------------------- registration
def _choose_ipu_strategy() -> None:
    """``Trainer(accelerator="ipu")`` without ``strategy=`` gets :class:`IPUStrategy`.

    Lightning 2.x has no public hook for an accelerator's default strategy (1.x chose the IPU
    strategy itself), so the connector's choice is wrapped for the IPU accelerator only.
    The wrapper keeps Lightning's own method as ``_ipukit_original`` and a later import
    (a reload) wraps that again, never its own wrapper; it tells the accelerator by the
    ``ipukit_virtual_ipus`` class marker and names the strategy by its registry name, so a
    reloaded module's classes are the ones used.
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
