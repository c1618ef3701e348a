"""The local exchange: every routed expert is on this rank, and no row travels.

Shape legend:
    T  tokens routed by this rank
    K  experts per token
    R  rows of the routed buffer, grouped by expert, alignment padding included

The layer's backend in one process, and under a parallel layout that holds every expert on each
rank (expert TP on gathered tokens without EP, an EP mesh of one rank). ``dispatch`` sorts the
pairs by expert (:func:`~dtensor_moe.routed.layouts.sort_by_expert`) and ``combine`` sums each
token's rows (:func:`~dtensor_moe.routed.layouts.unpermute_and_reduce`). No collective.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

from typing import Any

import torch

from dtensor_moe.routed.exchange import FEATURES, Routed, TokenExchange, register_exchange
from dtensor_moe.routed.layouts import Capacity, PaddedPairs, sort_by_expert, unpermute_and_reduce

__all__ = ["LocalExchange"]


@register_exchange
class LocalExchange(TokenExchange):
    """No exchange: see the module docstring. Takes no ``mesh``."""

    name = "local"
    hands_over_launches = True  # it launches nothing
    static_capacity = True
    features = FEATURES - {"expert_tp"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.mesh is not None:
            raise ValueError(
                f"the 'local' exchange sends no rows and takes no mesh, got {self.mesh}; use "
                "exchange='all_to_all' or 'all_gather' for expert parallelism"
            )

    def sort_and_send(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None,
    ) -> Routed:
        layout = sort_by_expert(
            topk_ids_TK, counts_E, pad_multiple=self.pad_multiple, capacity=capacity
        )
        padded = isinstance(layout, PaddedPairs)
        return Routed(
            source=x_TD,
            scores=scores_TK,
            layout=layout,
            row_TK=layout.row_TK,
            order_N=None if padded else layout.order_N,  # a permutation without padding
            void_row=padded and layout.void_row,
        )

    def _combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any) -> torch.Tensor:
        return unpermute_and_reduce(
            local_RD, routed.row_TK, None, order_N=routed.order_N, void_row=routed.void_row
        )

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """``pad_multiple > 1``, or a capacity without ``pad_to_capacity``: the row layout
        follows host counts."""
        return self.pad_multiple > 1 if capacity is None else not capacity.padded
