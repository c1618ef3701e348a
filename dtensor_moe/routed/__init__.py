"""The routed path: exchange backends, the plan, the layouts and the expert kernels.

See ``docs/moe.md`` ("Write an exchange backend") and Note [One plan] in ``experts.py``.
"""

from dtensor_moe.routed.all_gather import AllGatherExchange
from dtensor_moe.routed.all_to_all import AllToAllExchange
from dtensor_moe.routed.exchange import (
    Received,
    Routed,
    TokenExchange,
    exchange_class,
    exchange_names,
    register_exchange,
)
from dtensor_moe.routed.kernels import grouped_swiglu, resolve_compute_path
from dtensor_moe.routed.layouts import (
    Capacity,
    ExpertLayout,
    InOrder,
    PaddedPairs,
    PairSubset,
    SortedPairs,
    in_order,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    unpermute_and_reduce,
)
from dtensor_moe.routed.fixed import (
    FixedBufferExchange,
    check_exchanges,
    exchange_overflowed,
    needed_buffer_factor,
    reset_overflow,
    set_buffer_factor,
    step_without_overflow,
)
from dtensor_moe.routed.local import LocalExchange
from dtensor_moe.routed.experts import GroupedExperts, RoutedPlan, local_expert_weight

__all__ = [
    "AllGatherExchange",
    "AllToAllExchange",
    "Capacity",
    "ExpertLayout",
    "FixedBufferExchange",
    "GroupedExperts",
    "InOrder",
    "LocalExchange",
    "PaddedPairs",
    "PairSubset",
    "Received",
    "Routed",
    "RoutedPlan",
    "SortedPairs",
    "TokenExchange",
    "check_exchanges",
    "exchange_class",
    "exchange_names",
    "exchange_overflowed",
    "grouped_swiglu",
    "in_order",
    "local_expert_weight",
    "needed_buffer_factor",
    "permute_tokens",
    "register_exchange",
    "reset_overflow",
    "resolve_compute_path",
    "scores_in_rows",
    "set_buffer_factor",
    "sort_by_expert",
    "step_without_overflow",
    "unpermute_and_reduce",
]
