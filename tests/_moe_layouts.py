"""Parallel layouts of the tiny MoE LM on 4 ranks, for the FSDP and checkpoint tests.

Each layout names (dp, ep, tp, expert_tp, sequence_parallel); ``build_layout`` applies the
parallel styles (when ep or tp > 1) and then FSDP2, and returns the model with one fused AdamW
over all of its params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtensor_moe.parallel import build_moe_meshes, parallelize_moe
from dtensor_moe.parallel.fsdp import fully_shard_moe
from tests._moe_model import tensor_parallel_dense


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
    dp4_ep2=Layout(dp=4, ep=2),
    ep4=Layout(dp=4, ep=4),
    # EP over all dp x tp ranks, sequence parallel on
    dp2_tp2_ep4_sp=Layout(dp=2, ep=4, tp=2, sequence_parallel=True),
    # expert tensor parallelism on the tp ranks, no EP
    dp2_tp2_etp=Layout(dp=2, ep=1, tp=2, expert_tp=True),
    # EP2 x expert TP2, sequence parallel on
    dp2_ep2_tp2_sp=Layout(dp=2, ep=2, tp=2, expert_tp=True, sequence_parallel=True),
)
_RESHARD_PAIRS = [("dp4_ep2", "ep4"), ("dp2_ep2_tp2_sp", "ep4")]
PARITY_LAYOUTS = ("dp4_ep2", "dp2_tp2_ep4_sp", "dp2_tp2_etp")


def local_rows(name: str, rank: int, batch: int) -> slice:
    """The rows of the global batch that ``rank`` feeds the model (its dp shard)."""
    layout = LAYOUTS[name]
    dp_rank = rank // layout.tp
    per = batch // layout.dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def build_layout(name: str, model: nn.Module, lr: float = 1e-3, optimizer: str = "AdamW",
                 **opt_kwargs):
    layout = LAYOUTS[name]
    meshes = build_moe_meshes(dp=layout.dp, ep=layout.ep, tp=layout.tp,
                              expert_tp=layout.expert_tp)
    if layout.tp > 1:
        tensor_parallel_dense(model, meshes.dense["tp"],
                              sequence_parallel=layout.sequence_parallel)
    if layout.tp > 1 or layout.ep > 1:
        parallelize_moe(model, meshes, sequence_parallel=layout.sequence_parallel)
    fully_shard_moe(model, meshes, blocks=model.layers)
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr, fused=True, **opt_kwargs)
    return model, opt
