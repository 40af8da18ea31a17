"""``IPUStrategy``'s setup: :class:`TrainerSetup` refuses what ipukit cannot run (manual
optimisation, gradient clipping, accumulation schedules, several optimisers, ...), builds one
:class:`~ipukit.Options` per kind of run and turns each ``DataLoader`` into an
:class:`ipukit.DataLoader` whose batch is one call.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from ..data import DataLoader as _IpuDataLoader
from .base import CLIPPING_MESSAGE, STAGE_KEY, LightningError
from ..core.options import Options

from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from .strategy import IPUStrategy

class TrainerSetup:
    """Setup, options and data loaders of an ``IPUStrategy``, from the user's
    ``training_opts``/``inference_opts`` (or None)."""

    def __init__(self, strategy: "IPUStrategy", training_opts: Optional[Options] = None,
                 inference_opts: Optional[Options] = None) -> None:
        for name, opts in (("training_opts", training_opts), ("inference_opts", inference_opts)):
            if opts is not None and not isinstance(opts, Options):
                raise LightningError(f"IPUStrategy({name}={opts!r}): expected ipukit.Options() "
                                     "(poptorch.Options with `import ipukit as poptorch`).")
        self._strategy = strategy
        self.user_training_opts = training_opts
        self.user_inference_opts = inference_opts
        self.opts: Dict[str, Options] = {}   # stage key -> the options built at setup
        # during a fit: the trainer and its accumulate_grad_batches, restored at teardown
        self._saved_accumulation: Optional[Tuple["pl.Trainer", int]] = None

    def prepare(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> None:
        """Before Lightning's own setup: check, build the options, take over accumulation."""
        self._check_setup(trainer, module)
        self.opts = {}
        if trainer.state.fn == TrainerFn.FITTING:
            self.opts["train"] = self._options("train", trainer)
        for stage in ("validate", "test", "predict"):
            self.opts[stage] = self._options(stage, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # one Lightning batch is a whole ipukit call, accumulation included
            self._saved_accumulation = (trainer, trainer.accumulate_grad_batches)
            trainer.accumulate_grad_batches = 1

    def restore(self) -> None:
        """At teardown: give the trainer back its ``accumulate_grad_batches``."""
        if self._saved_accumulation is not None:
            trainer, accumulation = self._saved_accumulation
            trainer.accumulate_grad_batches = accumulation
        self._saved_accumulation = None

    def _check_setup(self, trainer, module) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        for hook in ("transfer_batch_to_device", "on_after_batch_transfer"):
            owner = next((o for o in (module, datamodule) if is_overridden(hook, o)), None)
            if owner is not None:
                raise LightningError(
                    f"Overriding `{hook}` is not supported with IPUs: "
                    f"{type(owner).__name__}.{hook} is overridden, but on ipukit the batch "
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
            raise LightningError(CLIPPING_MESSAGE.format(value=trainer.gradient_clip_val))
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise LightningError(
                "GradientAccumulationScheduler changes accumulate_grad_batches during training, "
                "but an ipukit training model is compiled for one gradientAccumulation. Use a "
                "fixed Trainer(accumulate_grad_batches=N).")

    def planned_replication_factor(self) -> int:
        """Replicas the options built at setup will have (lightning-graphcore's rule): the
        user's options' ``replicationFactor`` (training first), else ``devices``; an explicit
        ``devices`` also fills in options left at one replica."""
        devices = self._strategy.device_count
        user = next((o for o in (self.user_training_opts, self.user_inference_opts)
                     if o is not None), None)
        if user is None:
            return devices
        if self._strategy.devices_auto or devices == 1 or user.replication_factor != 1:
            return user.replication_factor
        return devices

    def _options(self, stage: str, trainer) -> Options:
        training = stage == "train"
        user = self.user_training_opts if training else self.user_inference_opts
        ga = int(trainer.accumulate_grad_batches) if training else 1
        replicas = self._strategy.device_count
        if user is None:
            opts = Options().deviceIterations(self._strategy.device_iterations)
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
            # devices="auto": the user's options decide, as in lightning-graphcore
            if (not self._strategy.devices_auto and replicas > 1
                    and opts.replication_factor != replicas):
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

    def process_dataloader(self, dataloader: object) -> object:
        """Each loader becomes an ``ipukit.DataLoader``: a batch is one whole ipukit call."""
        if isinstance(dataloader, _IpuDataLoader):
            return dataloader
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        trainer = self._strategy.lightning_module.trainer
        stage = STAGE_KEY.get(trainer.state.stage, "validate")
        opts = self.opts.get(stage) or self.opts.get("validate")
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
