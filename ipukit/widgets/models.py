"""The models the explorer is given, and the placement of those placed by ``layers_per_ipu``.

The explorer knows no model of its own: it receives **model specs**, objects with
the attributes of :class:`ipukit.examples.spec.ModelSpec` (each example exports
one: ``ipukit.examples.mnist.explorer_model()``, ``ipukit.examples.vit.explorer_model()``)
— ``name``, ``blocks``, ``factory``, ``wrap``, ``layered`` (with ``layers``,
``default_layers``, ``presets``), ``calibration_module()`` and ``sample_batch(size)``.
A model's blocks are placed

* **by stage split** (the convnet): the explorer's ``split`` control lists the
  blocks of each stage, and :func:`ipukit.widgets.logic.strategy_for` makes the
  :class:`~ipukit.Stage` objects;
* **by** ``layers_per_ipu`` (the ViT): as optimum-graphcore did it, the control
  holds an :class:`~ipukit.IPUConfig`'s ``layers_per_ipu`` and the model's own
  ``parallelize(ipu_config)`` places its blocks. :func:`layered_split` reads back
  where ``parallelize`` put every block; the explorer adds no placement rule of its own.

Nothing here imports ipywidgets, nor any example.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..core.blocks import begin_blocks
from ..core.errors import OptionsError
from ..ipuconfig.config import IPUConfig

#: what the explorer reads of a model spec
SPEC_ATTRIBUTES = ("name", "blocks", "factory", "wrap", "layered", "calibration_module",
                   "sample_batch")


class LayersPerIpuError(OptionsError):
    """A ``layers per IPU`` entry that is not a list of whole numbers."""


def by_name(models: Sequence[Any]) -> Dict[str, Any]:
    """``{spec.name: spec}`` of the explorer's models, in order; a ``TypeError`` names what
    a spec lacks, a ``ValueError`` a repeated name."""
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


# -- layers_per_ipu ------------------------------------------------------------------------

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
    """The :class:`~ipukit.IPUConfig` of a ``layers_per_ipu`` setting (one IPU per entry).

    ``ipus_per_replica`` is the number of entries, optimum's default. Raises
    :class:`ipukit.IPUConfigError` for values it refuses.
    """
    layers = [int(n) for n in layers_per_ipu]
    return IPUConfig(layers_per_ipu=layers, ipus_per_replica=len(layers), **attributes)


def annotated_ipus(network: torch.nn.Module) -> Dict[str, int]:
    """``{block: ipu_id}`` of every ``BeginBlock(module, name, ipu_id=...)`` in ``network``."""
    return {str(user_id): ipu_id for _, user_id, ipu_id in begin_blocks(network)
            if user_id is not None}


@functools.lru_cache(maxsize=256)
def _layered_split(model, layers_per_ipu: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    network = model.factory().parallelize(ipu_config_for(layers_per_ipu))
    placed = annotated_ipus(network)
    missing = [b for b in model.blocks if placed.get(b) is None]
    if missing:
        raise LayersPerIpuError(f"{model.name}.parallelize() placed no IPU for blocks {missing}")
    ipus = [placed[b] for b in model.blocks]
    stage_ipus: List[int] = []
    for ipu in ipus:
        if not stage_ipus or stage_ipus[-1] != ipu:
            stage_ipus.append(ipu)
    return tuple(ipus), tuple(stage_ipus)


def layered_split(model, layers_per_ipu: Sequence[int]
                  ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Where ``model.factory().parallelize(IPUConfig(layers_per_ipu=...))`` puts each block.

    Returns ``(ipu of each block, ipu of each stage)``: consecutive blocks on one
    IPU form a stage, as ipukit's compiler merges them. An IPU given no layer
    (``"4, 0, 4"``) holds no stage. Raises :class:`ipukit.IPUConfigError` with
    ``get_layer_ipu``'s message when the counts do not fit the model. Kept per
    (model spec, counts): the spec must be hashable (a frozen dataclass is).
    """
    if not model.layered:
        raise ValueError(f"layered_split: {model.name!r} is not placed by layers_per_ipu")
    return _layered_split(model, tuple(int(n) for n in layers_per_ipu))
