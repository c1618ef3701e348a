"""The MoE layer: token-choice router, grouped routed experts with a token dispatcher, and
shared experts. See ``docs/moe.md``."""

from dtensor_moe.moe.balance import (
    AuxLossBackward,
    AuxLosses,
    attach_aux_loss,
    collect_aux_losses,
    update_expert_bias,
)
from dtensor_moe.moe.config import MoEConfig
from dtensor_moe.moe.dispatch import (
    DispatchMetadata,
    ExpertLayout,
    TokenDispatcher,
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
    shared_mlp,
    swiglu_mlp,
)
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.router import (
    RouterOutput,
    TokenChoiceTopKRouter,
    aux_loss_from_sums,
    sequence_aux_loss,
    sequence_sums,
)

__all__ = [
    "AuxLossBackward",
    "AuxLosses",
    "DispatchMetadata",
    "ExpertLayout",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "RouterOutput",
    "SharedExperts",
    "TokenChoiceTopKRouter",
    "TokenDispatcher",
    "attach_aux_loss",
    "collect_aux_losses",
    "aux_loss_from_sums",
    "grouped_swiglu",
    "local_expert_weight",
    "permute_tokens",
    "scores_in_rows",
    "sequence_aux_loss",
    "sequence_sums",
    "sort_by_expert",
    "shared_mlp",
    "swiglu_mlp",
    "unpermute_and_reduce",
    "update_expert_bias",
]
