"""The model specs the explorer is given, and the placement of those placed by ``layers_per_ipu``.

A spec has the attributes of :class:`ipukit.examples.spec.ModelSpec` (e.g.
``ipukit.examples.mnist.explorer_model()``). Its blocks are placed by stage split (the
convnet: :func:`ipukit.widgets.logic.strategy_for`), or by an :class:`~ipukit.IPUConfig`'s
``layers_per_ipu`` and the model's own ``parallelize`` (the ViT, as optimum-graphcore
did): :func:`layered_split` reads back where it put every block. Nothing here imports
ipywidgets, nor any example.
"""
from __future__ import annotations

import functools
import itertools
import re
from typing import Any, Dict, Sequence, Tuple

from ..core.blocks import begin_blocks
from ..core.errors import OptionsError
from ..ipuconfig.config import IPUConfig

#: what the explorer reads of a model spec
SPEC_ATTRIBUTES = ("name", "blocks", "factory", "wrap", "layered", "calibration_module",
                   "sample_batch")


class LayersPerIpuError(OptionsError):
    """A ``layers per IPU`` entry that is not a list of whole numbers."""


def by_name(models: Sequence[Any]) -> Dict[str, Any]:
    """``{spec.name: spec}`` in order; a ``TypeError`` names what a spec lacks, a
    ``ValueError`` a repeated name."""
    out: Dict[str, Any] = {}
    for spec in models:
        missing = [a for a in SPEC_ATTRIBUTES if not hasattr(spec, a)]
        if missing:
            raise TypeError(f"{spec!r} is not a model spec: it has no {missing} (see "
                            "ipukit.examples.spec.ModelSpec, e.g. ipukit.examples.mnist."
                            "explorer_model())")
        if spec.name in out:
            raise ValueError(f"two models named {spec.name!r}")
        out[spec.name] = spec
    if not out:
        raise ValueError("the explorer needs at least one model spec, e.g. "
                         "models=[ipukit.examples.mnist.explorer_model()]")
    return out


def parse_layers(text: str, model) -> Tuple[int, ...]:
    """``"2, 2, 2, 2"`` (or ``"[2 2 2 2]"``) → ``(2, 2, 2, 2)``; ``-1`` is optimum's wildcard."""
    parts = [p for p in re.split(r"[\s,\[\]]+", str(text)) if p]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values:
        raise LayersPerIpuError(
            f"layers per IPU {text!r}: write one whole number per IPU, e.g. "
            f"{model.presets[0] if model.presets else '2, 2'!r}; -1 shares the layers the "
            f"other IPUs leave (the {model.name} has {model.layers} layers).")
    return values


def ipu_config_for(layers_per_ipu: Sequence[int], **attributes) -> IPUConfig:
    """The :class:`~ipukit.IPUConfig` of a ``layers_per_ipu`` setting, one IPU per entry
    (:class:`ipukit.IPUConfigError` for values it refuses)."""
    layers = [int(n) for n in layers_per_ipu]
    return IPUConfig(layers_per_ipu=layers, ipus_per_replica=len(layers), **attributes)


@functools.lru_cache(maxsize=256)
def _layered_split(model, layers_per_ipu: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    network = model.factory().parallelize(ipu_config_for(layers_per_ipu))
    placed = {str(user_id): ipu_id for _, user_id, ipu_id in begin_blocks(network)
              if user_id is not None}
    missing = [b for b in model.blocks if placed.get(b) is None]
    if missing:
        raise LayersPerIpuError(f"{model.name}.parallelize() placed no IPU for blocks {missing}")
    ipus = tuple(placed[b] for b in model.blocks)
    return ipus, tuple(ipu for ipu, _ in itertools.groupby(ipus))


def layered_split(model, layers_per_ipu: Sequence[int]
                  ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Where ``model.factory().parallelize(IPUConfig(layers_per_ipu=...))`` puts each block:
    ``(ipu of each block, ipu of each stage)`` (consecutive blocks on one IPU form a stage).

    :class:`ipukit.IPUConfigError` when the counts do not fit the model. Cached per (model
    spec, counts): the spec must be hashable.
    """
    if not model.layered:
        raise ValueError(f"layered_split: {model.name!r} is not placed by layers_per_ipu")
    return _layered_split(model, tuple(int(n) for n in layers_per_ipu))
