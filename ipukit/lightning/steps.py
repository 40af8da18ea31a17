"""``IPUStrategy``'s bridge from Lightning's ``*_step`` calls to ipukit models: each step becomes
the forward of a :class:`_StepModule`, wrapped once per kind of run and dataloader; one
training step is one call.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

import torch

from ..core.blocks import active_recorder
from ..core.errors import PipelineConfigError
from .base import STAGE_KEY, LightningError, map_tensors
from ..model import inferenceModel, trainingModel
from ..core.ops import identity_loss

from pytorch_lightning.trainer.states import RunningStage

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .setup import TrainerSetup
    from .strategy import IPUStrategy


def _state_to_parameter_devices(optimizer) -> None:
    """Optimiser state next to its parameter (Lightning restores it on the host); scalars
    (Adam's ``step``) stay where torch.optim wants them."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device != p.device:
                state[key] = value.to(p.device)


_STEP_OF = {RunningStage.TRAINING: "training_step", RunningStage.SANITY_CHECKING: "validation_step",
            RunningStage.VALIDATING: "validation_step", RunningStage.TESTING: "test_step",
            RunningStage.PREDICTING: "predict_step"}
_BATCH_END_HOOK = {"training_step": "on_train_batch_end",
                   "validation_step": "on_validation_batch_end",
                   "test_step": "on_test_batch_end", "predict_step": "on_predict_batch_end"}

_log_state = threading.local()
_log_lock = threading.RLock()


class _StepModule(torch.nn.Module):
    """The module ipukit wraps: its forward is one of the LightningModule's ``*_step`` methods
    (``batch_idx``, ``dataloader_idx`` are attributes, so only the batch is an input).
    """

    def __init__(self, module: "pl.LightningModule", step: str) -> None:
        super().__init__()
        self.module = module
        self.step = step
        self.extra_args: tuple = ()

    def forward(self, batch):
        rec = active_recorder()
        if rec is not None:
            # the loss, computed after forward's blocks closed, stays on the last block's IPU
            rec.keep_last_block_open = True
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


class StepBridge:
    """The step runs of an ``IPUStrategy``: one ipukit model per step kind and dataloader,
    sharing the LightningModule's weights, configured by ``setup.opts``."""

    def __init__(self, strategy: "IPUStrategy", setup: "TrainerSetup") -> None:
        self._strategy = strategy
        self._setup = setup
        self.models: Dict[tuple, Any] = {}   # (step, dataloader_idx) -> its ipukit model
        # the current run's dataloader-0 model per RunningStage (lightning-graphcore's dict)
        self.poptorch_models: Dict[RunningStage, Any] = {}
        self.last: Dict[str, Any] = {}       # stage key -> its latest ipukit model (kept after teardown)
        self._log_originals: Optional[Dict[str, Any]] = None

    def start(self) -> None:
        """At setup, before Lightning's: no models yet."""
        self.models = {}
        self.poptorch_models = {}

    def build(self, stages: Iterable[RunningStage]) -> None:
        """At setup, after Lightning's: the (uncompiled) models of ``stages``."""
        for stage in stages:
            self._wrapped(stage, 0)

    def release(self) -> None:
        """At teardown: unwrap the training models (the module can be trained again)."""
        for model in self.models.values():
            if model.training:
                model.destroy()
        self.models = {}

    def guard_logging(self, module: "pl.LightningModule") -> None:
        """Wrap ``module.log``/``log_dict``: a no-op while ipukit traces the step (calls are
        noted, see :meth:`_compile`); otherwise one thread at a time (replicas)."""
        originals = {}
        for name in ("log", "log_dict"):
            original = getattr(module, name)
            originals[name] = vars(module).get(name)

            def guarded(*args, _original=original, _name=name, **kwargs):
                if active_recorder() is not None:
                    noted = getattr(_log_state, "calls", None)
                    if noted is not None:
                        first = args[0] if args else kwargs.get("name", kwargs.get("dictionary"))
                        noted.append((_name, first if isinstance(first, str) else None))
                    return None
                with _log_lock:
                    return _original(*args, **kwargs)

            setattr(module, name, guarded)
        self._log_originals = originals

    def unguard_logging(self, module: "pl.LightningModule") -> None:
        """Give ``module`` back the ``log``/``log_dict`` it had before :meth:`guard_logging`."""
        if self._log_originals is None:
            return
        for name, original in self._log_originals.items():
            if original is None:
                if name in vars(module):
                    delattr(module, name)
            else:
                setattr(module, name, original)
        self._log_originals = None

    def _wrapped(self, stage: RunningStage, dataloader_idx: int):
        """The ipukit model of ``stage``'s step for one dataloader, made at its first use."""
        step = _STEP_OF[stage]
        key = (step, dataloader_idx)
        model = self.models.get(key)
        if model is None:
            wrapper = _StepModule(self._strategy.lightning_module, step)
            stage_key = STAGE_KEY[stage]
            if step == "training_step":
                model = trainingModel(wrapper, self._setup.opts["train"],
                                      optimizer=self._strategy.optimizers[0])
            else:
                model = inferenceModel(wrapper, self._setup.opts[stage_key])
            self.models[key] = model
        if dataloader_idx == 0:
            self.poptorch_models.setdefault(stage, model)
        return model

    def run(self, stage: RunningStage, args, kwargs) -> Any:
        """One Lightning ``*_step`` call: one call of that step's ipukit model."""
        if not args:
            raise LightningError("ipukit's IPU strategy expects the batch as the first argument "
                                 "of the step.")
        batch, extra = args[0], tuple(args[1:]) + tuple(kwargs.values())
        dataloader_idx = extra[1] if len(extra) > 1 and isinstance(extra[1], int) else 0
        model = self.last[STAGE_KEY[stage]] = self._wrapped(stage, dataloader_idx)
        model.model.extra_args = extra
        batch = self._cast_inputs(batch)
        if not model.isCompiled():
            self._compile(model, batch)
            if model.training:
                _state_to_parameter_devices(model.optimizer)
        return model(batch)

    def _cast_inputs(self, batch: Any) -> Any:
        """Float inputs take the model's floating dtype (PopTorch cast inputs of half models)."""
        dtype = next((p.dtype for p in self._strategy.lightning_module.parameters()
                      if p.is_floating_point()), None)
        if dtype is None:
            return batch
        return map_tensors(batch, lambda t: t.to(dtype)
                           if t.is_floating_point() and t.dtype != dtype else t)

    def _compile(self, model, batch) -> None:
        module = self._strategy.lightning_module
        # an earlier model may have put the shared weights on a GPU: trace on their device
        device = next((p.device for p in module.parameters()), None)
        if device is not None and device.type != "cpu":
            batch = map_tensors(batch, lambda t: t.to(device))
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
            self.models = {k: v for k, v in self.models.items() if v is not model}
            self.poptorch_models = {k: v for k, v in self.poptorch_models.items()
                                    if v is not model}
            raise LightningError(
                f"{type(module).__name__}.{step} calls self.log ({names}), but "
                f"ipukit traced it into {stages} pipeline stages: a traced step runs on the "
                "virtual IPUs and cannot call back into Lightning. Return the values instead "
                "(e.g. return {'loss': loss, 'acc': acc}) and log them in "
                f"{_BATCH_END_HOOK[step]}(self, outputs, batch, batch_idx), e.g. "
                "self.log('acc', outputs['acc']).")
