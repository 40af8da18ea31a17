"""optimum-graphcore's ``IPUConfig`` (``ipu_config.json``), turned into ipukit :class:`~ipukit.Options`.

Its behaviour as of optimum-graphcore 0.7: every attribute with its default, type and
minimum, the cross-checks, the inference twins and ``train()``/``eval()``, serialisation,
:func:`get_layer_ipu`, :func:`split_encoder_decoder_ipu_config` and
:func:`recomputation_checkpoint`. IPU compiler settings are accepted with no effect.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..core.errors import UnknownOptionError
from . import io, options
from .io import IPU_CONFIG_NAME
from .rules import (ATTRIBUTES, MANAGED, MODES, SPEC, IncompatibleIPUConfigError,
                    IPUConfigError, IPUConfigTypeError, check_value, cross_check,  # noqa: F401
                    is_int, mode_name, parse_updates, read_legacy, unknown_keys_error)


class IPUConfig:
    """optimum-graphcore's IPU configuration: batching, placement and IPU compiler settings.

    >>> config = IPUConfig(layers_per_ipu=[2, 2, 2, 2], gradient_accumulation_steps=8)
    >>> opts = config.to_options()                       # ipukit.Options for training
    >>> get_layer_ipu(config, 8)
    [0, 0, 1, 1, 2, 2, 3, 3]

    Every keyword is an attribute (docs/ipuconfig.md lists them with their defaults),
    checked on every assignment; an unknown keyword is an :class:`IncompatibleIPUConfigError`.
    The rules live in :mod:`.rules`, files and the Hub in :mod:`.io`, the conversion to
    Options in :mod:`.options`.
    """

    CONFIG_NAME = IPU_CONFIG_NAME
    FULL_CONFIGURATION_FILE = IPU_CONFIG_NAME
    modes = MODES

    def __init__(self, replication_factor: int = 1, inference_replication_factor: int = 1,
                 gradient_accumulation_steps: int = 1, layers_per_ipu: List[int] = (-1,),
                 inference_layers_per_ipu: Optional[List[int]] = None,
                 ipus_per_replica: Optional[int] = None,
                 inference_ipus_per_replica: Optional[int] = None,
                 optimizer_state_offchip: bool = False, replicated_tensor_sharding: bool = False,
                 matmul_proportion: Union[float, List[float]] = 0.2,
                 inference_matmul_proportion: Optional[Union[float, List[float]]] = None,
                 enable_half_partials: bool = True,
                 embedding_serialization_factor: Optional[int] = None,
                 inference_embedding_serialization_factor: Optional[int] = None,
                 serialized_embedding_splits_per_ipu: Optional[List[int]] = None,
                 inference_serialized_embedding_splits_per_ipu: Optional[List[int]] = None,
                 projection_serialization_factor: Optional[int] = None,
                 inference_projection_serialization_factor: Optional[int] = None,
                 serialized_projection_splits_per_ipu: Optional[List[int]] = None,
                 inference_serialized_projection_splits_per_ipu: Optional[List[int]] = None,
                 recompute_checkpoint_every_layer: bool = False, device_iterations: int = 1,
                 inference_device_iterations: int = 1, output_mode: str = "final",
                 seed: Optional[int] = None, auto_loss_scaling: bool = False,
                 executable_cache_dir: str = "", explicit_ir_inference: bool = False,
                 parallelize_kwargs: Optional[Dict[str, Any]] = None,
                 inference_parallelize_kwargs: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        object.__setattr__(self, "_mode", "training")
        object.__setattr__(self, "_notes", [])   # what loading an older file changed
        args = dict(locals())
        for drop in ("self", "kwargs", "__class__"):
            args.pop(drop, None)
        if isinstance(layers_per_ipu, tuple):
            args["layers_per_ipu"] = list(layers_per_ipu)
        args["execute_encoder_on_cpu_for_generation"] = kwargs.pop(
            "execute_encoder_on_cpu_for_generation", False)
        read_legacy(args, kwargs, self._notes)
        if kwargs:
            raise unknown_keys_error(kwargs, "received")

        self.seed = args["seed"]
        self.layers_per_ipu = args["layers_per_ipu"]
        # the inference twins fall back to the training values (copies: never aliased)
        self.inference_layers_per_ipu = args["inference_layers_per_ipu"] or self.layers_per_ipu
        self.ipus_per_replica = args["ipus_per_replica"] or len(self.layers_per_ipu)
        fallback = self.ipus_per_replica
        if fallback == len(self.layers_per_ipu) or self.inference_layers_per_ipu != [-1]:
            fallback = len(self.inference_layers_per_ipu)
        self.inference_ipus_per_replica = args["inference_ipus_per_replica"] or fallback
        self.matmul_proportion = args["matmul_proportion"]
        fallback = copy.copy(self.matmul_proportion)
        if isinstance(fallback, list) and len(fallback) != self.inference_ipus_per_replica:
            fallback = 0.2   # a per-IPU list that does not fit inference: the default
        self.inference_matmul_proportion = args["inference_matmul_proportion"] or fallback
        for name in ("parallelize_kwargs", "inference_parallelize_kwargs"):
            args[name] = {} if args[name] is None else args[name]
        for name in ATTRIBUTES:
            if name not in self.__dict__:
                setattr(self, name, args[name])
        self._validate_ipu_config()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SPEC:
            check_value(name, value)
            object.__setattr__(self, name, copy.deepcopy(value))
        elif name == "mode":
            type(self).mode.fset(self, value)
        elif name.startswith("_") and name[1:] in MANAGED:
            setattr(self, self._get_managed_attr_mode_name(name[1:]), value)
        elif name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            raise unknown_keys_error([name], "cannot set")

    def __getattr__(self, name: str):
        # only reached for names that are not set: the mode-dependent views and typos
        if name.startswith("_") and name[1:] in MANAGED:
            return getattr(self, self._get_managed_attr_mode_name(name[1:]))
        if name.startswith("_"):
            raise AttributeError(name)
        close = difflib.get_close_matches(name, ATTRIBUTES, n=1, cutoff=0.6)
        raise UnknownOptionError(
            f"IPUConfig has no attribute {name!r}." + (f" Did you mean {close[0]!r}?" if close
                                                       else " See docs/ipuconfig.md."))

    @property
    def mode(self) -> str:
        """``"training"`` or ``"inference"``: which twin the ``_attribute`` views read and write."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise IPUConfigError(
                f"IPUConfig.mode = {value!r}: use one of {list(MODES)}, or call "
                "ipu_config.train() / ipu_config.eval().")
        object.__setattr__(self, "_mode", value)

    def train(self) -> "IPUConfig":
        """Training mode: ``_layers_per_ipu`` and the other views read the training values."""
        self.mode = "training"
        return self

    def eval(self) -> "IPUConfig":
        """Inference mode: the views read ``inference_layers_per_ipu`` and the other twins."""
        self.mode = "inference"
        return self

    def _get_managed_attr_mode_name(self, attr: str) -> str:
        """The attribute a mode-dependent view refers to in the current mode (optimum's name)."""
        return mode_name(attr, self._mode)

    def _validate_ipu_config(self) -> "IPUConfig":
        """The rules between attributes, in both modes (:func:`.rules.cross_check`; optimum's name)."""
        return cross_check(self)

    @property
    def legacy_notes(self) -> List[str]:
        """What loading this configuration dropped or reinterpreted (older Hub files)."""
        return list(self._notes)

    def to_dict(self) -> Dict[str, Any]:
        """Every attribute (not the mode), as a JSON-serialisable dict."""
        return {name: copy.deepcopy(getattr(self, name)) for name in ATTRIBUTES}

    def to_json_string(self, use_diff: bool = True) -> str:
        """The configuration as JSON (sorted keys, 2-space indent); every attribute is written
        whatever ``use_diff`` says, as optimum's IPUConfig did."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: Union[str, os.PathLike], use_diff: bool = True) -> None:
        """Write :meth:`to_json_string` to ``json_file_path``."""
        io.write_text(json_file_path, self.to_json_string(use_diff))

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs: Any) -> str:
        """Write ``save_directory/ipu_config.json`` (the folder is created); returns the path."""
        path = io.save_path(save_directory, push_to_hub=bool(kwargs.get("push_to_hub")))
        self.to_json_file(path)
        return path

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], **kwargs: Any):
        """Build from a dict (an ``ipu_config.json``'s contents); ``kwargs`` override attributes
        (``return_unused_kwargs=True``: returns ``(config, unused)``).
        """
        return_unused = kwargs.pop("return_unused_kwargs", False)
        if not isinstance(config_dict, dict):
            raise IPUConfigError(f"IPUConfig.from_dict({config_dict!r}): expected a dict.")
        config = cls(**config_dict)
        unused = {k: v for k, v in kwargs.items() if k not in SPEC}
        if unused and not return_unused:
            raise unknown_keys_error(unused, "override has")
        for key, value in kwargs.items():
            if key in SPEC:
                setattr(config, key, value)
        if len(unused) < len(kwargs):
            config._validate_ipu_config()
        return (config, unused) if return_unused else config

    @classmethod
    def from_json_file(cls, json_file: Union[str, os.PathLike]) -> "IPUConfig":
        """Build from a JSON file."""
        return cls.from_dict(io.read_json(str(json_file)))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike],
                        **kwargs: Any):
        """Load an ``ipu_config.json``: a file, a folder holding one, or a Hugging Face Hub id.

        Keyword arguments naming attributes override the loaded values; ``revision=``,
        ``cache_dir=``, ``token=`` go to the Hub download (which needs ``pip install
        "ipukit[hub]"`` and the network); ``return_unused_kwargs=True`` returns
        ``(config, unused)``.
        """
        hub_kwargs = io.pop_hub_kwargs(kwargs)
        path = io.resolve(str(pretrained_model_name_or_path), hub_kwargs)
        return cls.from_dict(io.read_json(path), **kwargs)

    def update_from_string(self, update_str: str) -> "IPUConfig":
        """Update attributes from ``"name=value,name=value"`` (lists as ``[a b c]``, booleans
        as true/false, ``none`` for an optional attribute); the cross-checks run after all of
        them, e.g. ``"layers_per_ipu=[4 4],ipus_per_replica=2"``.
        """
        for key, value in parse_updates(update_str, self.to_dict()).items():
            setattr(self, key, value)
        self._validate_ipu_config()
        return self

    def batch_size_factor(self, for_inference: bool = False) -> int:
        """Combined batch ÷ micro-batch: replication × accumulation (training) × device iterations."""
        if for_inference:
            return self.inference_replication_factor * self.inference_device_iterations
        return (self.replication_factor * self.gradient_accumulation_steps
                * self.device_iterations)

    def to_options(self, for_inference: bool = False, compile_only: bool = False):
        """The :class:`~ipukit.Options` for training (or inference) this configuration describes.

        Honoured: replication, device iterations, gradient accumulation (Mean), the output mode
        (``All`` for inference), the seed, optimiser state off chip, and
        ``PipelinedExecution(AutoStage.AutoIncrement)`` (``ShardedExecution`` for inference).
        IPU compiler settings are recorded with no effect.
        """
        return options.to_options(self, for_inference, compile_only)

    def ignored_settings(self, for_inference: bool = False) -> Dict[str, Any]:
        """The IPU-only settings this configuration asks for that ipukit accepts and ignores,
        under their attribute names for the given mode."""
        return options.ignored_settings(self, for_inference)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, IPUConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"IPUConfig {self.to_json_string()}"

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        for key, value in self.__dict__.items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        return clone


def _expand_layers_per_ipu_wildcard(ipu_config: IPUConfig,
                                    target_number_of_layers: Optional[Union[int, Sequence]] = None
                                    ) -> List[int]:
    """``layers_per_ipu`` (current mode) with ``-1`` wildcards sharing what the counts leave
    evenly, the remainder on the last wildcard IPU."""
    layers = list(ipu_config._layers_per_ipu)
    layers_name = ipu_config._get_managed_attr_mode_name("layers_per_ipu")
    ipus = ipu_config._ipus_per_replica
    ipus_name = ipu_config._get_managed_attr_mode_name("ipus_per_replica")
    if target_number_of_layers is None:
        return layers
    if not is_int(target_number_of_layers):
        target_number_of_layers = len(target_number_of_layers)
    total = target_number_of_layers
    if ipus == 1:
        if -1 not in layers and sum(layers) != total:
            raise IncompatibleIPUConfigError(
                f"IPUConfig.{layers_name}={layers} places {sum(layers)} layers but the model "
                f"has {total}. Set {layers_name}=[{total}] or [-1].")
        return [total]
    if layers == [-1]:
        layers = [-1] * ipus
    if len(layers) != ipus:
        raise IncompatibleIPUConfigError(
            f"IPUConfig.{layers_name}={layers} has {len(layers)} entries but {ipus_name}={ipus}. "
            f"Give one entry per IPU (or [-1] to split the {total} layers evenly).")
    if -1 in layers:
        wildcards = [i for i, n in enumerate(layers) if n == -1]
        fixed = sum(n for n in layers if n != -1)
        remaining = total - fixed
        if remaining < 0:
            raise IncompatibleIPUConfigError(
                f"IPUConfig.{layers_name}={layers} places {fixed} layers on fixed IPUs but the "
                f"model has only {total}, leaving {remaining} for the -1 entries. Lower the fixed "
                "counts so they add up to at most the number of layers.")
        quotient, remainder = divmod(remaining, len(wildcards))
        for i in wildcards:
            layers[i] = quotient
        layers[wildcards[-1]] += remainder
        return layers
    if sum(layers) != total:
        raise IncompatibleIPUConfigError(
            f"IPUConfig.{layers_name}={layers} places {sum(layers)} layers but the model has "
            f"{total}. Change the counts to add up to {total}, or use -1 entries.")
    return layers


def get_layer_ipu(ipu_config: IPUConfig,
                  layers_or_count: Optional[Union[int, Sequence]] = None) -> List[int]:
    """The IPU of each layer (``[0, 0, 0, 1, 1, 1, ...]``) from ``layers_per_ipu``.

    ``layers_or_count`` is the number of layers, or the layers themselves (a ``ModuleList``).
    """
    if not isinstance(ipu_config, IPUConfig):
        raise IPUConfigError(f"get_layer_ipu({ipu_config!r}, ...): expected an ipukit.IPUConfig.")
    layer_ipu: List[int] = []
    for ipu, count in enumerate(_expand_layers_per_ipu_wildcard(ipu_config, layers_or_count)):
        layer_ipu += [ipu] * count
    return layer_ipu


def split_encoder_decoder_ipu_config(ipu_config: IPUConfig, num_encoder_layers: int,
                                     num_decoder_layers: int) -> Tuple[IPUConfig, IPUConfig]:
    """Split an encoder-decoder model's configuration into ``(encoder, decoder)`` ones.

    ``layers_per_ipu`` is cut where the encoder's layers end, on a power-of-two number of
    IPUs; per-IPU lists are cut the same way (serialised embedding splits must all be on the
    encoder, projection splits on the decoder). Raises ``IncompatibleIPUConfigError``.
    """
    ipus_name = ipu_config._get_managed_attr_mode_name("ipus_per_replica")
    layers_name = ipu_config._get_managed_attr_mode_name("layers_per_ipu")
    if ipu_config._ipus_per_replica < 2:
        raise IncompatibleIPUConfigError(
            f"split_encoder_decoder_ipu_config: {ipus_name}={ipu_config._ipus_per_replica}; "
            "splitting into encoder and decoder configurations needs at least 2 IPUs.")
    layers = _expand_layers_per_ipu_wildcard(ipu_config, num_encoder_layers + num_decoder_layers)
    cuts = [i + 1 for i in range(len(layers)) if sum(layers[:i + 1]) == num_encoder_layers]
    cuts = [c for c in cuts if c & (c - 1) == 0]
    if not cuts:
        raise IncompatibleIPUConfigError(
            f"split_encoder_decoder_ipu_config: cannot split {layers_name}="
            f"{ipu_config._layers_per_ipu} (expanded {layers}) after {num_encoder_layers} encoder "
            f"layers: encoder and decoder layers may not share an IPU, and the encoder's part "
            "must use a power-of-two number of IPUs. Change layers_per_ipu accordingly.")
    cut = max(cuts)
    encoder, decoder = copy.deepcopy(ipu_config), copy.deepcopy(ipu_config)
    encoder._layers_per_ipu, decoder._layers_per_ipu = layers[:cut], layers[cut:]
    embedding = ipu_config._serialized_embedding_splits_per_ipu
    if embedding is not None:
        if sum(embedding[cut:]):
            raise IncompatibleIPUConfigError(
                f"split_encoder_decoder_ipu_config: serialized embedding splits {embedding} put "
                f"{embedding[cut:]} on the decoder's IPUs; place them all on the encoder's.")
        encoder._serialized_embedding_splits_per_ipu = embedding[:cut]
        decoder._serialized_embedding_splits_per_ipu = None
    projection = ipu_config._serialized_projection_splits_per_ipu
    if projection is not None:
        if sum(projection[:cut]):
            raise IncompatibleIPUConfigError(
                f"split_encoder_decoder_ipu_config: serialized projection splits {projection} put "
                f"{projection[:cut]} on the encoder's IPUs; place them all on the decoder's.")
        encoder._serialized_projection_splits_per_ipu = None
        decoder._serialized_projection_splits_per_ipu = projection[cut:]
    encoder._ipus_per_replica = len(encoder._layers_per_ipu)
    decoder._ipus_per_replica = len(decoder._layers_per_ipu)
    matmul = ipu_config._matmul_proportion
    if isinstance(matmul, list):
        encoder._matmul_proportion, decoder._matmul_proportion = matmul[:cut], matmul[cut:]
    return encoder, decoder


class _Recompute:
    """``module.forward`` replaced: the class's forward under ``torch.utils.checkpoint`` (an
    object, not a closure, so that copies and ``torch.save`` of the module keep it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        from ..core.blocks import note_recompute

        note_recompute()  # while ipukit traces: its stage recomputes (see partition)
        forward = type(self.module).forward
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, self.module, *args,
                                                     use_reentrant=False, **kwargs)
        return forward(self.module, *args, **kwargs)


class RecomputationHandle:
    """Returned by :func:`recomputation_checkpoint`; ``remove()`` restores the plain forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        if isinstance(self.module.__dict__.get("forward"), _Recompute):
            del self.module.__dict__["forward"]


def recomputation_checkpoint(module: torch.nn.Module) -> RecomputationHandle:
    """Keep only ``module``'s output for the backward pass and recompute its inside.

    The module's forward runs under ``torch.utils.checkpoint`` (non-reentrant) whenever
    gradients are recorded; in a model traced into several stages, the whole stage holding
    the module recomputes (see docs/ipuconfig.md). Returns a handle whose ``remove()`` undoes
    it.
    """
    if not isinstance(module, torch.nn.Module):
        raise IPUConfigError(f"recomputation_checkpoint({module!r}): expected a torch.nn.Module.")
    if not isinstance(module.__dict__.get("forward"), _Recompute):
        module.forward = _Recompute(module)
    return RecomputationHandle(module)
