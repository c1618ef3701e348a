"""The all-gather exchange: every rank gathers all tokens and routing, computes its experts' rows,
and the outputs return by reduce-scatter.

Shape legend:
    T  tokens routed by this rank; U  the most tokens any rank of the mesh routes
    P  ranks of the mesh; e  experts each rank holds
    D  model width        K  experts per token
    R  rows this rank computes: the gathered pairs of its own experts

Note [All-gather exchange]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Registered as ``"all_gather"`` (Megatron-Core's allgather dispatcher does the same). Each rank
of the mesh:

1. all-gathers the sizes ``T`` (a host read, as the all-to-all's count exchange), pads its
   tokens to ``U`` rows, and all-gathers them with their combine weights as one ``(U, D + K)``
   buffer, and their expert ids as one ``(U, K)`` buffer: every rank then holds every token;
2. sorts the gathered pairs of its own experts by local expert
   (:func:`~dtensor_moe.routed.layouts.sort_by_expert` with ``elsewhere``: every other pair,
   and every padding row, takes the void row), and the experts compute them, weighted, from
   the gathered tokens (``Routed.source``);
3. sums each gathered token's rows (other ranks' experts give zero), ``(P * U, D)``, and
   reduce-scatters the sums: each rank gets the complete output of its own ``U`` rows, of which
   it keeps ``T``.

Autograd runs the reverse: the backward of the reduce-scatter gathers the output gradients,
and the backward of the gather reduce-scatters the input and weight gradients, so each rank's
tokens get the sum over every rank's experts. Collectives on the mesh: forward 3 all-gathers
(sizes, tokens, ids) and 1 reduce-scatter; backward 1 all-gather and 1 reduce-scatter, all
torch's functional collectives. It sends ``P`` times a rank's tokens where the all-to-all sends
``K`` rows per token: the better choice at small EP degrees and high top-k.

Expert TP by exchange (``replicas > 1``, ``ExpertTensorParallel(dispatch="all_to_all",
exchange="all_gather")``) needs nothing more: rank ``q`` of the flattened mesh computes the
hidden slice ``q % replicas`` of the experts of EP rank ``q // replicas``, and the
reduce-scatter sums the slices with the experts. No own-rows overlap (every row is gathered);
no static exchange at capacity (``pad_to_capacity``); the collectives are functional, so they
do not hand over to ``overlap_f_b`` (which refuses this backend by name).
"""

# ruff: noqa: N803, N806

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from dtensor_moe.routed.exchange import FEATURES, Routed, TokenExchange, register_exchange
from dtensor_moe.routed.layouts import Capacity, sort_by_expert, unpermute_and_reduce

__all__ = ["AllGatherExchange"]


@register_exchange
class AllGatherExchange(TokenExchange):
    """Expert-parallel dispatch and combine by all-gather and reduce-scatter over a 1-D mesh;
    see Note [All-gather exchange]. The mesh holds the ranks that exchange rows, in the order of
    Note [Expert TP by all-to-all] in ``all_to_all.py``."""

    name = "all_gather"
    hands_over_launches = False
    static_capacity = False
    features = FEATURES - {"own_rows"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.mesh is None:
            raise ValueError(
                "the 'all_gather' exchange needs a mesh of the ranks that exchange rows; use "
                "exchange='local' when every expert is on this rank"
            )
        self._first_expert = (self.rank // self.replicas) * self.experts_per_rank

    def sort_and_send(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None,
    ) -> Routed:
        T, K = topk_ids_TK.shape
        D, e = x_TD.shape[1], self.experts_per_rank
        sizes = funcol.all_gather_single(
            torch.tensor([T], device=x_TD.device), 0, self.mesh
        ).tolist()
        U = max(sizes)
        rows_TX = torch.cat((x_TD, scores_TK), dim=1)  # each token with its K weights
        ids_TK = topk_ids_TK
        if U > T:  # padding rows: no expert here or anywhere (id E, the void row)
            rows_TX = F.pad(rows_TX, (0, 0, 0, U - T))
            ids_TK = F.pad(ids_TK, (0, 0, 0, U - T), value=self.num_experts)
        rows_all = funcol.all_gather_single_autograd(rows_TX, 0, self.mesh)
        ids_all = funcol.all_gather_single(ids_TK, 0, self.mesh)
        local = ids_all - self._first_expert
        local = torch.where((local >= 0) & (local < e), local, e)  # others: past every expert
        counts_e = torch.bincount(local.reshape(-1), minlength=e + 1)[:e]
        layout = sort_by_expert(local, counts_e, pad_multiple=self.pad_multiple, elsewhere=True)
        return Routed(
            source=rows_all[:, :D],
            scores=rows_all[:, D:],
            layout=layout,
            row_TK=layout.row_TK,
            order_N=None,
            void_row=True,
            exchange=T,
        )

    def _combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any) -> torch.Tensor:
        sums = unpermute_and_reduce(local_RD, routed.row_TK, None, void_row=True)  # (P * U, D)
        mine_UD = funcol.reduce_scatter_single_autograd(sums, "sum", 0, self.mesh)
        mine_UD = funcol.wait_tensor(mine_UD)
        T = routed.exchange
        return mine_UD if mine_UD.shape[0] == T else mine_UD[:T].clone()

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """Always: the token counts and the rows of its experts are read on the host."""
        return True
