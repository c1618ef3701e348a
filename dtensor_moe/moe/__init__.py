"""The MoE layer: token-choice router, grouped routed experts with a token dispatcher, and
shared experts. See ``docs/moe.md``."""

from dtensor_moe.moe.balance import (
    AuxLossBackward,
    AuxLosses,
    attach_aux_loss,
    collect_aux_losses,
    set_aux_loss_group,
    update_expert_bias,
)
from dtensor_moe.moe.config import MoEConfig
from dtensor_moe.moe.dispatch import (
    ExpertLayout,
    Received,
    Routed,
    TokenDispatcher,
    in_order,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    unpermute_and_reduce,
)
from dtensor_moe.moe.experts import (
    GroupedExperts,
    SharedExperts,
    grouped_swiglu,
    local_expert_weight,
)
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.losses import global_aux_loss_from_sums, router_losses, z_loss
from dtensor_moe.moe.protocol import Router, RouterLossSettings
from dtensor_moe.moe.router import (
    RouterOutput,
    TokenChoiceTopKRouter,
    aux_loss_from_sums,
    sequence_aux_loss,
    sequence_sums,
    set_router_loss_scale,
)
from dtensor_moe.moe.stats import LayerLoad, load_stats

__all__ = [
    "AuxLossBackward",
    "AuxLosses",
    "Received",
    "Routed",
    "ExpertLayout",
    "GroupedExperts",
    "LayerLoad",
    "MoE",
    "MoEConfig",
    "Router",
    "RouterLossSettings",
    "RouterOutput",
    "SharedExperts",
    "TokenChoiceTopKRouter",
    "TokenDispatcher",
    "attach_aux_loss",
    "collect_aux_losses",
    "aux_loss_from_sums",
    "global_aux_loss_from_sums",
    "grouped_swiglu",
    "in_order",
    "load_stats",
    "local_expert_weight",
    "permute_tokens",
    "router_losses",
    "scores_in_rows",
    "sequence_aux_loss",
    "sequence_sums",
    "set_aux_loss_group",
    "set_router_loss_scale",
    "sort_by_expert",
    "unpermute_and_reduce",
    "update_expert_bias",
    "z_loss",
]
