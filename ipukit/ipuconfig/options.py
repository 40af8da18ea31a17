"""An ``IPUConfig`` turned into ipukit :class:`~ipukit.Options` (what is honoured) and the
IPU compiler settings it accepts and ignores, for the mode asked for (the config's own mode
is left alone)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..core.enums import AutoStage, OutputMode, ReductionType
from ..core.errors import UnsupportedError
from ..core.options import Options, TensorLocationSettings
from ..core.strategies import PipelinedExecution, ShardedExecution
from .rules import mode_name

_OUTPUT_MODES = {"all": OutputMode.All, "sum": OutputMode.Sum, "final": OutputMode.Final,
                 "default": OutputMode.Default}


def to_options(config, for_inference: bool = False, compile_only: bool = False) -> Options:
    """See :meth:`ipukit.IPUConfig.to_options`."""
    if config.execute_encoder_on_cpu_for_generation:
        raise UnsupportedError(
            "IPUConfig.execute_encoder_on_cpu_for_generation=True is not supported "
            "(optimum-graphcore did not support it either); set it to false.")
    mode = "inference" if for_inference else "training"
    opts = Options()
    opts.autoRoundNumIPUs(True)
    opts.replicationFactor(config.inference_replication_factor if for_inference
                           else config.replication_factor)
    opts.deviceIterations(config.inference_device_iterations if for_inference
                          else config.device_iterations)
    if for_inference:
        opts.outputMode(OutputMode.All)
    else:
        opts.Training.gradientAccumulation(config.gradient_accumulation_steps)
        opts.Training.accumulationAndReplicationReductionType(ReductionType.Mean)
        if config.auto_loss_scaling:
            opts.Training.setAutomaticLossScaling(True)
        opts.outputMode(_OUTPUT_MODES[config.output_mode])
    if config.seed is not None:
        opts.randomSeed(config.seed)
    opts.TensorLocations.setOptimizerLocation(
        TensorLocationSettings().useOnChipStorage(not config.optimizer_state_offchip)
        .useReplicatedTensorSharding(config.replicated_tensor_sharding
                                     and opts.replication_factor > 1))
    strategy = ShardedExecution if for_inference else PipelinedExecution
    opts.setExecutionStrategy(strategy(AutoStage.AutoIncrement))
    if compile_only:
        opts.useOfflineIpuTarget()
    ipus = getattr(config, mode_name("ipus_per_replica", mode))
    proportion = getattr(config, mode_name("matmul_proportion", mode))
    if not isinstance(proportion, list):
        proportion = [proportion] * ipus
    opts.setAvailableMemoryProportion({f"IPU{i}": p for i, p in enumerate(proportion[:ipus])})
    if config.executable_cache_dir and config.executable_cache_dir != "disabled":
        opts.enableExecutableCaching(config.executable_cache_dir)
    opts.Precision.enableStochasticRounding(not for_inference)
    if config.enable_half_partials:
        opts.Precision.setPartialsType(torch.float16)
    return opts


def ignored_settings(config, for_inference: bool = False) -> Dict[str, Any]:
    """See :meth:`ipukit.IPUConfig.ignored_settings`."""
    mode = "inference" if for_inference else "training"
    found: Dict[str, Any] = {}
    name = mode_name("matmul_proportion", mode)
    found[name] = getattr(config, name)
    for flag in ("enable_half_partials", "auto_loss_scaling"):
        if getattr(config, flag) and not (for_inference and flag == "auto_loss_scaling"):
            found[flag] = True
    if config.replicated_tensor_sharding:
        found["replicated_tensor_sharding"] = True
    if config.executable_cache_dir:
        found["executable_cache_dir"] = config.executable_cache_dir
    if for_inference and config.explicit_ir_inference:
        found["explicit_ir_inference"] = True
    for layer in ("embedding", "projection"):
        for attr in (f"{layer}_serialization_factor", f"serialized_{layer}_splits_per_ipu"):
            name = mode_name(attr, mode)
            value = getattr(config, name)
            if value is not None and value != 1:
                found[name] = value
    return found
