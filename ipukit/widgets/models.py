"""The models the explorer can pipeline: the tutorial's convnet and the example ViT.

A :class:`ExampleModel` says how to build a network, how to make it a training
model (the convnet gets its loss wrapper; the ViT computes its own loss) and
how its blocks are placed on virtual IPUs:

* **by stage split** (the convnet): the explorer's ``split`` control lists the
  blocks of each stage, and :func:`ipukit.widgets.logic.strategy_for` makes the
  :class:`~ipukit.Stage` objects;
* **by** ``layers_per_ipu`` (the ViT): as optimum-graphcore did it, the control
  holds an :class:`~ipukit.IPUConfig`'s ``layers_per_ipu`` and the model's own
  ``parallelize(ipu_config)`` places its blocks (``get_layer_ipu`` for the
  encoder layers, the embeddings and the head where the model puts them).
  :func:`layered_split` reads back where ``parallelize`` put every block; the
  explorer adds no placement rule of its own.

Nothing here imports ipywidgets.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.blocks import begin_blocks
from ..core.errors import OptionsError
from ..ipuconfig.config import IPUConfig


class LayersPerIpuError(OptionsError):
    """A ``layers per IPU`` entry that is not a list of whole numbers."""


@dataclass(frozen=True)
class ExampleModel:
    """A network the explorer can build, train and place.

    ``layers`` > 0 means the model is placed by ``layers_per_ipu`` through an
    :class:`~ipukit.IPUConfig` and its ``parallelize(ipu_config)`` method; its
    ``presets`` are offered in the control, ``default_layers`` is the start.
    """

    name: str
    blocks: Tuple[str, ...]
    factory: Callable[[], torch.nn.Module]
    wrap: Callable[[torch.nn.Module], torch.nn.Module]
    layers: int = 0
    default_layers: Tuple[int, ...] = ()
    presets: Tuple[str, ...] = ()
    micro_batch_size: int = 40

    @property
    def layered(self) -> bool:
        return self.layers > 0


def _identity(network: torch.nn.Module) -> torch.nn.Module:
    return network


def _convnet() -> ExampleModel:
    from ..examples import mnist

    return ExampleModel("convnet", tuple(mnist.BLOCKS), mnist.Network, mnist.TrainingModelWithLoss)


def _vit() -> ExampleModel:
    from ..examples.vit import CONFIG_PATH, ViT

    config = IPUConfig.from_pretrained(CONFIG_PATH)
    layers = sum(config.layers_per_ipu)
    blocks = ("Embedding", *(f"Encoder{i}" for i in range(layers)), "LayerNorm", "Classifier")
    presets = ("2, 2, 2, 2", "1, 1, 1, 1, 1, 1, 1, 1", "3, 3, 1, 1", "-1, -1, -1, -1", "3, -1, -1",
               "4, 4", "-1, -1", "0, 4, 4", f"{layers}")
    return ExampleModel("ViT", blocks, functools.partial(ViT, num_layers=layers), _identity,
                        layers=layers, default_layers=tuple(config.layers_per_ipu),
                        presets=presets, micro_batch_size=16)


@functools.lru_cache(maxsize=None)
def example_models() -> Dict[str, ExampleModel]:
    """The explorer's model choices, by name: ``"convnet"`` (the tutorial's) and ``"ViT"``."""
    return {m.name: m for m in (_convnet(), _vit())}


def custom_model(factory, wrap, blocks) -> ExampleModel:
    """A user's network, placed by stage split (the explorer's ``model_factory=`` argument)."""
    return ExampleModel("custom", tuple(blocks), factory, wrap)


# -- layers_per_ipu ------------------------------------------------------------------------

def parse_layers(text: str, model: ExampleModel) -> Tuple[int, ...]:
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
def _layered_split(name: str, layers_per_ipu: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    model = example_models()[name]
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


def layered_split(model: ExampleModel, layers_per_ipu: Sequence[int]
                  ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Where ``model.parallelize(IPUConfig(layers_per_ipu=...))`` puts each block.

    Returns ``(ipu of each block, ipu of each stage)``: consecutive blocks on one
    IPU form a stage, as ipukit's compiler merges them. An IPU given no layer
    (``"4, 0, 4"``) holds no stage. Raises :class:`ipukit.IPUConfigError` with
    ``get_layer_ipu``'s message when the counts do not fit the model.
    """
    if model.name not in example_models() or example_models()[model.name] is not model:
        raise ValueError(f"layered_split: {model.name!r} is not one of the explorer's models")
    return _layered_split(model.name, tuple(int(n) for n in layers_per_ipu))

