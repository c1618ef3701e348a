"""A tiny MoE language model shared by the FSDP/checkpoint tests, and its single-device twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe import MoE, MoEConfig
from dtensor_moe.parallel import DenseNames, parallelize_dense

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


# The tiny model's names for dtensor_moe.parallel.parallelize_dense: its MLP stands in for the
# attention, so ``up`` is the column-wise and ``down`` the row-wise projection, and ``up``
# all-gathers its own input under sequence parallelism (nothing in ``gathered``).
DENSE_NAMES = DenseNames(
    embedding="embed",
    gathered=(),
    colwise=("up",),
    rowwise=("down",),
    norms=("norm1", "norm2"),
    output="head",
)


def tensor_parallel_dense(model: TinyMoELM, tp_mesh, *, sequence_parallel: bool) -> None:
    """Megatron-style TP (+ SP) of the dense layers: the package's dense plan."""
    parallelize_dense(model, tp_mesh, sequence_parallel=sequence_parallel, names=DENSE_NAMES)
