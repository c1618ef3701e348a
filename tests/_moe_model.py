"""A tiny MoE language model shared by the FSDP/checkpoint tests, and its single-device twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe import MoE, MoEConfig

VOCAB = 32
DIM = 16


def moe_config(**overrides) -> MoEConfig:
    fields = dict(dim=DIM, hidden_dim=32, num_experts=4, top_k=2, num_shared_experts=1,
                  shared_hidden_dim=16)
    fields.update(overrides)
    return MoEConfig(**fields)


class Block(nn.Module):
    """A dense MLP (standing in for attention) then an MoE, each with a pre-norm residual."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.norm2 = nn.RMSNorm(DIM)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(F.silu(self.up(self.norm1(x))))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, config: MoEConfig, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(config) for _ in range(num_layers)])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, **config_overrides) -> TinyMoELM:
    torch.manual_seed(seed)
    return TinyMoELM(moe_config(**config_overrides))


def global_batch(step: int, batch: int, seq_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, seq_len + 1), generator=gen)


def tensor_parallel_dense(model: TinyMoELM, tp_mesh, *, sequence_parallel: bool) -> None:
    """Megatron-style TP (+ SP) of the dense layers with torch's own styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    act = Shard(1) if sequence_parallel else Replicate()
    # With SP the residual stream stays a Shard(1) DTensor (use_local_output=False), so the
    # MoE output (same layout as its input) adds to it directly.
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=act,
                                 use_local_output=not sequence_parallel),
        "head": ColwiseParallel(input_layouts=act, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers:
        block_plan = {
            "up": ColwiseParallel(input_layouts=act),
            "down": RowwiseParallel(output_layouts=act, use_local_output=not sequence_parallel),
        }
        if sequence_parallel:
            block_plan["norm1"] = SequenceParallel()
            block_plan["norm2"] = SequenceParallel()
        parallelize_module(block, tp_mesh, block_plan)
