"""A small Vision Transformer for MNIST, placed on virtual IPUs from an :class:`~ipukit.IPUConfig`.

The shape of Hugging Face's ``ViTForImageClassification`` at toy size: a patch embedding,
``num_layers`` identical pre-norm encoder layers, a LayerNorm and a linear classifier on the
class token; ``forward(images, labels=None)`` returns the logits, or ``(logits, loss)``.
:meth:`ViT.parallelize` follows optimum-graphcore's ``PipelinedViTForImageClassification``
(embeddings on IPU 0, encoder layer ``i`` on ``get_layer_ipu(ipu_config, layers)[i]``, the
head and loss on the last IPU, recomputation per layer with
``recompute_checkpoint_every_layer``); :meth:`ViT.deparallelize` undoes it. The layers are
identical, so ``layers_per_ipu`` balances the pipeline. ``CONFIG_PATH`` is the IPU
configuration of ``ipukit-mnist --model vit``; :func:`explorer_model` is the dashboard's spec.
"""
from __future__ import annotations

import functools
import math
import os
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.blocks import BeginBlock, removeBlocks
from ..ipuconfig.config import IPUConfig, get_layer_ipu, recomputation_checkpoint
from ..timeline.costs import CostTable
from .spec import ModelSpec, linear_costs

CONFIG_PATH = os.path.join(os.path.dirname(__file__), "vit_ipu_config.json")


class PatchEmbedding(nn.Module):
    """Image → ``1 + (28 / patch)²`` tokens: class token, then one token per patch, plus positions."""

    def __init__(self, dim: int, patch: int = 7, image: int = 28, channels: int = 1):
        super().__init__()
        if image % patch:
            raise ValueError(f"patch={patch} must divide the image size {image}")
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, 1 + (image // patch) ** 2, dim) * 0.02)

    def forward(self, images):
        x = self.proj(images).flatten(2).transpose(1, 2)          # (batch, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.position


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def attention(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // h), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """A Vision Transformer classifier for 28×28 single-channel images (MNIST)."""

    def __init__(self, num_layers: int = 8, dim: int = 64, heads: int = 4, mlp_dim: int = 128,
                 patch: int = 7, classes: int = 10):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r}: expected an int >= 1")
        self.embeddings = PatchEmbedding(dim, patch)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, mlp_dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, classes)
        self.ipu_config: Optional[IPUConfig] = None
        self._hooks: List = []

    def forward(self, images, labels=None):
        x = self.embeddings(images)
        for layer in self.layers:
            x = layer(x)
        logits = self.classifier(self.norm(x)[:, 0])
        if labels is None:
            return logits
        return logits, F.cross_entropy(logits, labels)

    # -- placement on virtual IPUs, optimum-graphcore's pattern -----------------
    def parallelize(self, ipu_config: Optional[IPUConfig] = None) -> "ViT":
        """Place the model on IPUs by ``ipu_config`` (in its train/eval mode): embeddings on IPU 0,
        encoder layer ``i`` on ``get_layer_ipu(...)[i]``, the head on the last IPU. Returns the model.
        """
        if ipu_config is not None:
            if not isinstance(ipu_config, IPUConfig):
                raise TypeError(f"ViT.parallelize({ipu_config!r}): expected an ipukit.IPUConfig")
            self.ipu_config = ipu_config
        if self.ipu_config is None:
            raise AttributeError("ViT.parallelize(): no IPUConfig; pass one, e.g. "
                                 "model.parallelize(ipukit.IPUConfig.from_pretrained(CONFIG_PATH))")
        self.deparallelize()
        config = self.ipu_config
        layer_ipu = get_layer_ipu(config, self.layers)
        BeginBlock(self.embeddings, "Embedding", ipu_id=0)
        for index, layer in enumerate(self.layers):
            if config.recompute_checkpoint_every_layer:
                self._hooks.append(recomputation_checkpoint(layer))
            BeginBlock(layer, f"Encoder{index}", ipu_id=layer_ipu[index])
        last_ipu = config._ipus_per_replica - 1
        BeginBlock(self.norm, "LayerNorm", ipu_id=last_ipu)
        BeginBlock(self.classifier, "Classifier", ipu_id=last_ipu)
        return self

    def deparallelize(self) -> "ViT":
        """Remove the blocks and recomputation hooks added by :meth:`parallelize`."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        removeBlocks(self)
        return self

    def layer_ipus(self) -> List[int]:
        """The IPU of each encoder layer under the current configuration."""
        if self.ipu_config is None:
            raise AttributeError("ViT.layer_ipus(): call parallelize(ipu_config) first")
        return get_layer_ipu(self.ipu_config, self.layers)


def num_layers_for(ipu_config: IPUConfig, default: int = 8) -> int:
    """The depth a configuration was written for: ``sum(layers_per_ipu)`` without wildcards."""
    layers = ipu_config._layers_per_ipu
    return default if -1 in layers else sum(layers)


# The ViT's reference costs (width 64, 17 tokens), (fixed, per sample) seconds, from
# ipukit.balance.measure_blocks at micro-batches of 4 to 64 samples, rounded. Every encoder layer costs the same; the embedding and the head (with the loss)
# are small.
_REFERENCE = {
    "forward": {"Embedding": (4.0e-4, 4.0e-6), "Encoder": (3.0e-4, 3.2e-5),
                "LayerNorm": (5.0e-5, 1.5e-6), "Classifier": (8.0e-5, 1.0e-6)},
    "backward": {"Embedding": (3.0e-4, 7.0e-6), "Encoder": (3.5e-4, 5.0e-5),
                 "LayerNorm": (5.0e-5, 1.5e-6), "Classifier": (4.7e-4, 6.0e-6)},
}


def reference_costs(micro_batch_size: int = 16, num_layers: int = 8) -> CostTable:
    """The ViT's fixed reference cost table: numbers that do not depend on
    the machine (its identical encoder layers cost the same)."""
    blocks = ("Embedding", *(f"Encoder{i}" for i in range(num_layers)), "LayerNorm", "Classifier")
    kind_of = {b: "Encoder" if b.startswith("Encoder") else b for b in blocks}
    fixed = {k: {b: table[kind_of[b]][0] for b in blocks} for k, table in _REFERENCE.items()}
    per_sample = {k: {b: table[kind_of[b]][1] for b in blocks} for k, table in _REFERENCE.items()}
    return linear_costs(blocks, fixed, per_sample, micro_batch_size,
                        source="the ViT's reference costs")


@functools.lru_cache(maxsize=None)
def explorer_model(config_path: str = CONFIG_PATH) -> ModelSpec:
    """The ViT as the notebook dashboard takes it: placed by ``layers_per_ipu`` (its
    IPUConfig's to start, a few others offered), micro-batches of 16 MNIST images. One spec per
    ``config_path`` (the same object on every call)."""
    config = IPUConfig.from_pretrained(config_path)
    layers = num_layers_for(config)
    presets = ("2, 2, 2, 2", "1, 1, 1, 1, 1, 1, 1, 1", "3, 3, 1, 1", "-1, -1, -1, -1", "3, -1, -1",
               "4, 4", "-1, -1", "0, 4, 4", f"{layers}")
    blocks = tuple(reference_costs(16, layers).blocks)
    return ModelSpec("ViT", blocks, functools.partial(ViT, num_layers=layers), layers=layers,
                     alike=(tuple(b for b in blocks if b.startswith("Encoder")),),
                     layer_blocks=tuple(b for b in blocks if b.startswith("Encoder")),
                     together=(("LayerNorm", "Classifier"),),
                     default_layers=tuple(config.layers_per_ipu), presets=presets,
                     micro_batch_size=16,
                     reference_costs=functools.partial(reference_costs, num_layers=layers))
