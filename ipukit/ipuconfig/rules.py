"""What an ``IPUConfig`` may hold: optimum-graphcore's attribute table (``SPEC``) and its
rules, on plain values or a configuration's public attributes: per attribute
(:func:`check_value`), between attributes (:func:`cross_check`), older Hub files
(:func:`read_legacy`) and ``update_from_string``'s text (:func:`parse_updates`).
"""
from __future__ import annotations

import difflib
import json
import logging
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..core.errors import OptionsError

OUTPUT_MODES = ("all", "sum", "final", "default")
MODES = ("training", "inference")

_log = logging.getLogger("ipukit")


class IPUConfigError(OptionsError):
    """An ``IPUConfig`` attribute with a value it cannot take (a ``ValueError``)."""


class IncompatibleIPUConfigError(IPUConfigError):
    """Unknown keys, or attributes that contradict each other (a ``ValueError``, as in optimum)."""


class IPUConfigTypeError(IPUConfigError, TypeError):
    """An ``IPUConfig`` attribute assigned a value of the wrong type (also a ``TypeError``)."""


# name -> (kind, default, minimum). Kinds: int, bool, str, ints (list of int),
# prop (float or list of float), dict; "?" suffix: None allowed.
SPEC: Dict[str, Tuple[str, Any, Optional[float]]] = {
    "replication_factor": ("int", 1, 1),
    "inference_replication_factor": ("int", 1, 1),
    "gradient_accumulation_steps": ("int", 1, 1),
    "layers_per_ipu": ("ints", [-1], -1),
    "inference_layers_per_ipu": ("ints", None, -1),
    "ipus_per_replica": ("int", None, 1),
    "inference_ipus_per_replica": ("int", None, 1),
    "optimizer_state_offchip": ("bool", False, None),
    "replicated_tensor_sharding": ("bool", False, None),
    "matmul_proportion": ("prop", 0.2, 0),
    "inference_matmul_proportion": ("prop", None, 0),
    "enable_half_partials": ("bool", True, None),
    "embedding_serialization_factor": ("int?", None, 1),
    "inference_embedding_serialization_factor": ("int?", None, 1),
    "serialized_embedding_splits_per_ipu": ("ints?", None, 0),
    "inference_serialized_embedding_splits_per_ipu": ("ints?", None, 0),
    "projection_serialization_factor": ("int?", None, 1),
    "inference_projection_serialization_factor": ("int?", None, 1),
    "serialized_projection_splits_per_ipu": ("ints?", None, 0),
    "inference_serialized_projection_splits_per_ipu": ("ints?", None, 0),
    "recompute_checkpoint_every_layer": ("bool", False, None),
    "device_iterations": ("int", 1, 1),
    "inference_device_iterations": ("int", 1, 1),
    "output_mode": ("str", "final", None),
    "seed": ("int?", None, 0),
    "auto_loss_scaling": ("bool", False, None),
    "executable_cache_dir": ("str", "", None),
    "explicit_ir_inference": ("bool", False, None),
    "parallelize_kwargs": ("dict", None, None),
    "inference_parallelize_kwargs": ("dict", None, None),
    "execute_encoder_on_cpu_for_generation": ("bool", False, None),
}
ATTRIBUTES = tuple(SPEC)
# attributes with a training and an inference value, switched by train()/eval()
MANAGED = ("layers_per_ipu", "ipus_per_replica", "matmul_proportion",
           "embedding_serialization_factor", "serialized_embedding_splits_per_ipu",
           "projection_serialization_factor", "serialized_projection_splits_per_ipu",
           "parallelize_kwargs")
_SPLITS = tuple(n for n in SPEC if n.endswith("_splits_per_ipu"))
_FACTORS = tuple(n for n in SPEC if n.endswith("serialization_factor"))
# keys of older Hub files
METADATA_KEYS = ("optimum_version", "transformers_version")
DEPRECATED_KEYS = {
    "enable_half_first_order_momentum":
        "half-precision first-order momentum is set on the optimiser, not the IPUConfig "
        "(ipukit keeps optimiser state in float32 in any case)",
    "sharded_execution_for_inference": "inference always uses sharded execution",
}
_TYPE_WORDS = {"int": "an int", "bool": "a bool (true/false)", "str": "a string",
               "ints": "a list of ints", "prop": "a float or a list of floats",
               "dict": "a dict"}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KIND_CHECKS = {
    "int": is_int,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ints": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
    "prop": lambda v: _is_number(v) or (isinstance(v, list) and len(v) > 0
                                        and all(_is_number(x) for x in v)),
    "dict": lambda v: isinstance(v, dict),
}


def _type_ok(kind: str, value: Any) -> bool:
    return (kind.endswith("?") and value is None) or _KIND_CHECKS[kind.rstrip("?")](value)


def check_value(name: str, value: Any) -> None:
    """The per-attribute rules: type, minimum, output_mode values, splits on consecutive IPUs."""
    kind, _, minimum = SPEC[name]
    if not _type_ok(kind, value):
        allowed = _TYPE_WORDS[kind.rstrip("?")] + (" or None" if kind.endswith("?") else "")
        raise IPUConfigTypeError(
            f"IPUConfig.{name} = {value!r}: expected {allowed}, got {type(value).__name__}. "
            f"Set {name} to {allowed} (see docs/ipuconfig.md).")
    if value is None:
        return
    if minimum is not None:
        items = value if isinstance(value, list) else [value]
        if any(v < minimum for v in items):
            what = "every element" if isinstance(value, list) else "the value"
            raise IPUConfigError(
                f"IPUConfig.{name} = {value!r}: {what} must be >= {minimum}. "
                f"Use values >= {minimum}" + (" (-1 is the wildcard: split the remaining layers "
                                             "evenly)." if name.endswith("layers_per_ipu") else "."))
    if name == "output_mode" and value not in OUTPUT_MODES:
        raise IPUConfigError(
            f"IPUConfig.output_mode = {value!r}: use one of {list(OUTPUT_MODES)} "
            "('default' returns 'all' for inference and 'final' for training).")
    if name in _SPLITS:
        if sum(value) < 1:
            raise IPUConfigError(
                f"IPUConfig.{name} = {value!r}: put at least 1 split on 1 IPU, or set it to None.")
        for i, splits in enumerate(value[:-1]):
            if splits and value[i + 1] == 0 and sum(value[i + 1:]) != 0:
                raise IPUConfigError(
                    f"IPUConfig.{name} = {value!r}: the splits must be on consecutive IPUs "
                    "(no zeros between IPUs holding splits), e.g. [3, 1, 0, 0] not [3, 0, 1, 0].")


def unknown_keys_error(keys: Iterable[str], where: str) -> IncompatibleIPUConfigError:
    lines = []
    for key in sorted(keys):
        close = difflib.get_close_matches(key, ATTRIBUTES, n=1, cutoff=0.6)
        lines.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return IncompatibleIPUConfigError(
        f"IPUConfig {where} unknown keys: {', '.join(lines)}. Remove them, or use "
        f"IPUConfig's attributes: {', '.join(ATTRIBUTES)}.")


def mode_name(attr: str, mode: str) -> str:
    """The attribute a mode-dependent name means in ``mode``: ``inference_<attr>`` or ``attr``."""
    return f"inference_{attr}" if attr in MANAGED and mode == "inference" else attr


def read_legacy(args: Dict[str, Any], kwargs: Dict[str, Any], notes: List[str]) -> None:
    """Older Hub files: drop metadata and deprecated keys (a factor of 0 means unset), editing the
    constructor's ``args``/``kwargs`` in place and noting each change in ``notes`` (the warnings'
    ``stacklevel`` assumes ``IPUConfig.__init__`` calls it).
    """
    for key in METADATA_KEYS:
        if key in kwargs:
            notes.append(f"{key}={kwargs.pop(key)!r}: metadata, dropped")
    for key, why in DEPRECATED_KEYS.items():
        if key in kwargs:
            value = kwargs.pop(key)
            note = f"{key}={value!r}: deprecated and dropped ({why})"
            notes.append(note)
            warnings.warn(f"IPUConfig: {note}.", UserWarning, stacklevel=4)
    for name in _FACTORS:
        if args.get(name) == 0 and not isinstance(args.get(name), bool):
            args[name] = None
            note = f"{name}=0: read as unset (1, not serialised), as older files meant"
            notes.append(note)
            warnings.warn(f"IPUConfig: {note}.", UserWarning, stacklevel=4)


def cross_check(config):
    """The rules between attributes, in both modes (optimum's ``_validate_ipu_config``); an
    unset serialisation factor becomes 1. Returns ``config``."""
    if config.replicated_tensor_sharding and config.replication_factor == 1:
        _log.warning("IPUConfig: replicated_tensor_sharding is not used when "
                     "replication_factor=1")
    for mode in MODES:
        ipus_name = mode_name("ipus_per_replica", mode)
        ipus = getattr(config, ipus_name)
        matmul_name = mode_name("matmul_proportion", mode)
        matmul = getattr(config, matmul_name)
        if isinstance(matmul, list) and len(matmul) != ipus:
            raise IncompatibleIPUConfigError(
                f"IPUConfig.{matmul_name}={matmul} has {len(matmul)} entries but "
                f"{ipus_name}={ipus}: give one proportion per IPU, or a single float for all.")
        layers_name = mode_name("layers_per_ipu", mode)
        layers = getattr(config, layers_name)
        if -1 not in layers and len(layers) != ipus:
            raise IncompatibleIPUConfigError(
                f"IPUConfig.{layers_name}={layers} places layers on {len(layers)} IPUs but "
                f"{ipus_name}={ipus}: give one entry per IPU (-1 entries split the remaining "
                f"layers evenly), or set {ipus_name}={len(layers)}.")
        for layer in ("embedding", "projection"):
            splits_name = mode_name(f"serialized_{layer}_splits_per_ipu", mode)
            factor_name = mode_name(f"{layer}_serialization_factor", mode)
            splits, factor = getattr(config, splits_name), getattr(config, factor_name)
            if not (splits or factor):
                setattr(config, factor_name, 1)
            elif splits and factor:
                raise IncompatibleIPUConfigError(
                    f"IPUConfig: only one of {factor_name}={factor} and {splits_name}="
                    f"{splits} may be set. Use {factor_name} to serialise the {layer} "
                    f"layer on one IPU, or {splits_name} to spread its splits over "
                    "chosen IPUs.")
            if splits and len(splits) != ipus:
                raise IncompatibleIPUConfigError(
                    f"IPUConfig.{splits_name}={splits} has {len(splits)} entries but "
                    f"{ipus_name}={ipus}: give one entry per IPU.")
    return config


def parse_updates(update_str: str, current: Dict[str, Any]) -> Dict[str, Any]:
    """``update_from_string``'s ``"name=value,..."``, each value read as its attribute's kind
    (``current``: the present values, quoted when one cannot be read)."""
    if not isinstance(update_str, str):
        raise IPUConfigError(f"IPUConfig.update_from_string({update_str!r}): expected a string "
                             "such as 'device_iterations=4,layers_per_ipu=[2 2]'.")
    updates = {}
    for item in update_str.split(","):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise IPUConfigError(
                f"IPUConfig.update_from_string({update_str!r}): {item!r} is not name=value. "
                "Separate updates with commas and list items with spaces: "
                "'device_iterations=4,layers_per_ipu=[2 2]'.")
        if key not in SPEC:
            raise unknown_keys_error([key], "update_from_string:")
        updates[key] = _parse_value(key, text.strip(), current[key])
    return updates


def _parse_value(key: str, text: str, old: Any) -> Any:
    """One ``update_from_string`` value, read as the type of the attribute."""
    kind = SPEC[key][0]
    lower = text.lower()
    try:
        if lower in ("none", "null") and kind.endswith("?"):
            return None
        if text.startswith("[") and text.endswith("]"):
            return json.loads("[" + ",".join(text[1:-1].split()) + "]")
        if kind == "bool":
            if lower in ("true", "1", "y", "yes"):
                return True
            if lower in ("false", "0", "n", "no"):
                return False
            raise ValueError(text)
        if kind.startswith("int"):
            return int(text)
        if kind == "prop":
            return float(text)
        if kind == "str":
            return text
    except (ValueError, json.JSONDecodeError):
        pass
    raise IPUConfigError(
        f"IPUConfig.update_from_string: {key}={text!r} cannot be read as "
        f"{_TYPE_WORDS[kind.rstrip('?')]} (current value {old!r}). Write booleans as true/false "
        "and lists as [a b c].")
