"""Parallel layouts of the tiny MoE LM on 4 ranks, for the FSDP and checkpoint tests.

Each layout names (dp, ep, tp, expert_tp, sequence_parallel); ``build_layout`` applies the
parallel styles (when ep or tp > 1) and then FSDP2, and returns the model with one fused AdamW
over all of its params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtensor_moe.parallel import build_moe_meshes
from dtensor_moe.parallel.fsdp import fully_shard_moe


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int
    tp: int = 1
    expert_tp: bool = False
    sequence_parallel: bool = False


class _Layouts(dict):
    def reshard_pairs(self) -> list[tuple[str, str]]:
        """(save, load) pairs that the checkpoint test covers."""
        return [(s, l) for s, l in _RESHARD_PAIRS if s in self and l in self]


LAYOUTS = _Layouts(
    dp4=Layout(dp=4, ep=1),
)
_RESHARD_PAIRS = [("dp4", "dp4")]


def local_rows(name: str, rank: int, batch: int) -> slice:
    """The rows of the global batch that ``rank`` feeds the model (its dp shard)."""
    layout = LAYOUTS[name]
    dp_rank = rank // layout.tp
    per = batch // layout.dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def build_layout(name: str, model: nn.Module, lr: float = 1e-3):
    layout = LAYOUTS[name]
    meshes = build_moe_meshes(dp=layout.dp, ep=layout.ep, tp=layout.tp,
                              expert_tp=layout.expert_tp)
    fully_shard_moe(model, meshes, blocks=model.layers)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
