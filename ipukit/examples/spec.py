"""What a dashboard needs to know of a model: :class:`ModelSpec`, one per example.

The dashboard (:class:`ipukit.widgets.PipelineExplorer`) knows no model of its own: it reads
a spec's ``factory`` and ``wrap``; its placement, by a stage split of ``blocks``
(``layers == 0``) or by the network's own ``parallelize`` from ``layers_per_ipu``
(``layers > 0``: ``presets``, ``default_layers``, ``layer_blocks``, ``together``); one
sample's shape and the starting micro-batch size; and optionally ``reference_costs``, a fixed
cost table for lessons whose numbers must not depend on the reader's machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..core.strategies import PipelinedExecution, ShardedExecution, Stage
from ..ipuconfig.config import IPUConfig
from ..timeline.costs import CostTable


def identity(network: torch.nn.Module) -> torch.nn.Module:
    """The ``wrap`` of a model that computes its own loss."""
    return network


@dataclass(frozen=True)
class ModelSpec:
    """A network a dashboard can build, place, calibrate and train (see the module docstring)."""

    name: str
    blocks: Tuple[str, ...]
    factory: Callable[[], torch.nn.Module]
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = identity
    layers: int = 0
    default_layers: Tuple[int, ...] = ()
    presets: Tuple[str, ...] = ()
    micro_batch_size: int = 40
    sample_shape: Tuple[int, ...] = (1, 28, 28)
    classes: int = 10
    reference_costs: Optional[Callable[[int], CostTable]] = None
    #: groups of blocks that do the same work (the ViT's encoder layers): a calibration
    #: gives each block of a group the group's median, so that a neighbour's load while
    #: one of them was timed does not make a balanced split look unbalanced
    alike: Tuple[Tuple[str, ...], ...] = ()
    #: for a model placed by ``layers_per_ipu``: the blocks its counts place (the ViT's encoder
    #: layers), and groups of blocks its ``parallelize`` always puts on one IPU (the ViT's
    #: final norm and classifier); the dashboard's Suggest plans within them
    layer_blocks: Tuple[str, ...] = ()
    together: Tuple[Tuple[str, ...], ...] = ()

    @property
    def layered(self) -> bool:
        """Placed by ``layers_per_ipu`` through its ``parallelize(ipu_config)``."""
        return self.layers > 0

    def strategy(self, split: Sequence[int], sharded: bool = False):
        """The execution strategy putting block ``b`` on IPU ``split[b]`` (ids must not
        decrease along the model)."""
        split = tuple(split)
        if len(split) != len(self.blocks):
            raise ValueError(f"split needs one IPU per block {self.blocks}, got {split}")
        stages = [Stage(*[b for b, i in zip(self.blocks, split) if i == ipu]).ipu(ipu)
                  for ipu in sorted(set(split))]
        return (ShardedExecution if sharded else PipelinedExecution)(*stages)

    def calibration_module(self) -> torch.nn.Module:
        """A fresh training module with every block its own stage (what calibration times)."""
        network = self.factory()
        if self.layered:
            one_each = [1] * self.layers
            return network.parallelize(IPUConfig(layers_per_ipu=one_each,
                                                  ipus_per_replica=len(one_each)))
        return self.wrap(network)

    def sample_batch(self, micro_batch_size: Optional[int] = None, seed: int = 0):
        """One micro-batch of inputs and labels (random, fixed by ``seed``)."""
        size = int(micro_batch_size or self.micro_batch_size)
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(size, *self.sample_shape, generator=generator),
                torch.randint(0, self.classes, (size,), generator=generator))


def linear_costs(blocks: Sequence[str], fixed: Mapping[str, Mapping[str, float]],
                 per_sample: Mapping[str, Mapping[str, float]], micro_batch_size: int,
                 step: float = 1.0e-3, host: float = 1.0e-3, source: str = "") -> CostTable:
    """A reference :class:`~ipukit.timeline.costs.CostTable`: each block's ``forward`` and
    ``backward`` pass costs ``fixed[kind][block] + per_sample[kind][block] × micro_batch_size``
    seconds; ``step`` is the optimiser step, ``host`` a call's host work."""
    def pass_costs(kind: str) -> list:
        return [fixed[kind][b] + per_sample[kind][b] * micro_batch_size for b in blocks]

    notes: Dict[str, str] = {"source": source or "reference costs"}
    return CostTable(list(blocks), pass_costs("forward"), pass_costs("backward"), step=step,
                     host_before=host, micro_batch=int(micro_batch_size), notes=notes)
