"""A small MoE transformer language model: the template for a user's own model.

Shape legend:
    B  sequences, L  tokens per sequence
    D  model width (``dim``)
    V  vocabulary size
    h  attention heads held by this rank (all of them without tensor parallelism)
    Dh head width (``dim // heads``)

The model is written for one device. Nothing in it knows about meshes: the parallel layout is
applied afterwards by :func:`dtensor_moe.demo.layout.apply_layout`, which targets the child
names used here (``tok_embeddings``, ``layers.<i>.attention.wq`` ...). Two details make that
possible:

- ``Attention`` reshapes with ``view(B, L, -1, Dh)``, so the same code runs with all heads or with
  the ``heads / tp`` heads that column-wise tensor parallelism leaves on a rank.
- Every block is ``x + f(norm(x))``: under sequence parallelism the residual stream stays a
  ``Shard(1)`` DTensor and each ``f`` declares its input and output layouts.

Note [Decisive routing]
~~~~~~~~~~~~~~~~~~~~~~~
Top-k routing is discontinuous: when two experts' scores for a token are within float
rounding of each other, a parallel run (whose sums run in another order) may pick the other
expert, and from then on the two runs train different, equally valid models. With the
``MoEConfig.init_std`` of 0.02 the router starts with nearly uniform scores, and such near-ties
happen within a few dozen steps. The router gate is therefore initialised at the usual
``1/sqrt(dim)`` scale, which keeps score gaps far above fp32 rounding, so the distributed run
and its single-process rerun route every token the same way. The demo checks that (it compares
the per-expert token counts of every step) before it compares losses, and fails when any step
differs (Note [Demo parity] in ``report.py``).
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe import MoE, MoEConfig

__all__ = ["Attention", "Block", "MoETransformer", "ModelConfig"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of :class:`MoETransformer`; ``moe`` configures every MoE feed-forward layer."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    moe: MoEConfig
    rope_theta: float = 10000.0
    init_std: float = field(default=0.02)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope(x_BLhDh: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over dim 1 of ``(B, L, h, Dh)``, positions ``0..L-1``."""
    _, L, _, Dh = x_BLhDh.shape
    freqs = theta ** (-torch.arange(0, Dh, 2, dtype=torch.float32) / Dh)
    angles_LF = torch.outer(torch.arange(L, dtype=torch.float32), freqs)
    cos, sin = angles_LF.cos()[None, :, None, :], angles_LF.sin()[None, :, None, :]
    x1, x2 = x_BLhDh.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x_BLhDh.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions (no bias, no KV cache)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = rope(self.wq(x).view(B, L, -1, self.head_dim), self.rope_theta)
        k = rope(self.wk(x).view(B, L, -1, self.head_dim), self.rope_theta)
        v = self.wv(x).view(B, L, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.moe_norm = nn.RMSNorm(config.dim)
        self.moe = MoE(config.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    """Token embeddings, ``n_layers`` MoE blocks, a final RMSNorm and an LM head.

    ``forward(tokens_BL) -> logits_BLV``. Weights are initialised from the global torch RNG, so
    building the model after ``torch.manual_seed(s)`` gives the same weights in every process.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._init_dense_weights()

    def _init_dense_weights(self) -> None:
        std = self.config.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for block in self.layers:
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
                nn.init.normal_(linear.weight, std=std)
            # residual projections: scaled down with depth (GPT-2 style)
            nn.init.normal_(block.attention.wo.weight, std=std / math.sqrt(2 * len(self.layers)))
        nn.init.normal_(self.output.weight, std=self.config.dim**-0.5)
        for block in self.layers:
            # See Note [Decisive routing].
            nn.init.normal_(block.moe.router.gate.weight, std=self.config.dim**-0.5)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens_BL)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))
