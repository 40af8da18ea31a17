"""An ``IPUConfig`` turned into ipukit :class:`~ipukit.Options`.

The conversion half of optimum-graphcore's ``IPUConfig``, as a mixin of
:class:`~ipukit.IPUConfig`: the batch-size factor, ``to_options`` (what ipukit
honours) and ``ignored_settings`` (the IPU compiler settings it accepts and
ignores). Both read the mode-dependent views of the mode asked for.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..core.enums import AutoStage, OutputMode, ReductionType
from ..core.errors import UnsupportedError


class _IPUConfigOptions:
    """``IPUConfig``'s batching and its translation into ``Options``."""

    def batch_size_factor(self, for_inference: bool = False) -> int:
        """Combined batch ÷ micro-batch: replication × gradient accumulation (1 for inference) × device iterations."""
        if for_inference:
            return self.inference_replication_factor * self.inference_device_iterations
        return (self.replication_factor * self.gradient_accumulation_steps
                * self.device_iterations)

    def to_options(self, for_inference: bool = False, compile_only: bool = False):
        """The :class:`~ipukit.Options` for training (or inference) that this configuration describes.

        Honoured: replication, device iterations, gradient accumulation (reduced
        with Mean), the output mode (``All`` for inference), the seed, optimiser
        state off chip, and the execution strategy:
        ``PipelinedExecution(AutoStage.AutoIncrement)`` for training,
        ``ShardedExecution(AutoStage.AutoIncrement)`` for inference. Blocks give the
        IPUs (``parallelize``). IPU compiler settings are recorded, no effect.
        """
        from ..core.options import Options, TensorLocationSettings
        from ..core.strategies import PipelinedExecution, ShardedExecution

        if self.execute_encoder_on_cpu_for_generation:
            raise UnsupportedError(
                "IPUConfig.execute_encoder_on_cpu_for_generation=True is not supported "
                "(optimum-graphcore did not support it either); set it to false.")
        with self._in_mode("inference" if for_inference else "training"):
            opts = Options()
            opts.autoRoundNumIPUs(True)
            opts.replicationFactor(self.inference_replication_factor if for_inference
                                   else self.replication_factor)
            opts.deviceIterations(self.inference_device_iterations if for_inference
                                  else self.device_iterations)
            if for_inference:
                opts.outputMode(OutputMode.All)
            else:
                opts.Training.gradientAccumulation(self.gradient_accumulation_steps)
                opts.Training.accumulationAndReplicationReductionType(ReductionType.Mean)
                if self.auto_loss_scaling:
                    opts.Training.setAutomaticLossScaling(True)
                opts.outputMode({"all": OutputMode.All, "sum": OutputMode.Sum,
                                 "final": OutputMode.Final,
                                 "default": OutputMode.Default}[self.output_mode])
            if self.seed is not None:
                opts.randomSeed(self.seed)
            opts.TensorLocations.setOptimizerLocation(
                TensorLocationSettings().useOnChipStorage(not self.optimizer_state_offchip)
                .useReplicatedTensorSharding(self.replicated_tensor_sharding
                                             and opts.replication_factor > 1))
            strategy = ShardedExecution if for_inference else PipelinedExecution
            opts.setExecutionStrategy(strategy(AutoStage.AutoIncrement))
            if compile_only:
                opts.useOfflineIpuTarget()
            proportion = self._matmul_proportion
            if not isinstance(proportion, list):
                proportion = [proportion] * self._ipus_per_replica
            opts.setAvailableMemoryProportion(
                {f"IPU{i}": p for i, p in enumerate(proportion[:self._ipus_per_replica])})
            if self.executable_cache_dir and self.executable_cache_dir != "disabled":
                opts.enableExecutableCaching(self.executable_cache_dir)
            opts.Precision.enableStochasticRounding(not for_inference)
            if self.enable_half_partials:
                opts.Precision.setPartialsType(torch.float16)
        return opts

    def ignored_settings(self, for_inference: bool = False) -> Dict[str, Any]:
        """The IPU-only settings this configuration uses that ipukit accepts and ignores.

        Only values that ask for something (a half-precision partials flag, a
        serialisation factor above 1, a cache folder, ...) are listed, under their
        attribute names for the given mode.
        """
        with self._in_mode("inference" if for_inference else "training"):
            found: Dict[str, Any] = {}
            name = self._get_managed_attr_mode_name("matmul_proportion")
            found[name] = getattr(self, name)
            for flag in ("enable_half_partials", "auto_loss_scaling"):
                if getattr(self, flag) and not (for_inference and flag == "auto_loss_scaling"):
                    found[flag] = True
            if self.replicated_tensor_sharding:
                found["replicated_tensor_sharding"] = True
            if self.executable_cache_dir:
                found["executable_cache_dir"] = self.executable_cache_dir
            if for_inference and self.explicit_ir_inference:
                found["explicit_ir_inference"] = True
            for layer in ("embedding", "projection"):
                for attr in (f"{layer}_serialization_factor", f"serialized_{layer}_splits_per_ipu"):
                    name = self._get_managed_attr_mode_name(attr)
                    value = getattr(self, name)
                    if value is not None and value != 1:
                        found[name] = value
            return found
