"""The MoE layer: token-choice router, the routed experts (``dtensor_moe.routed``), shared
experts, the router's losses, balance and load statistics. See ``docs/moe.md``."""

from dtensor_moe.moe.balance import (
    AuxLossBackward,
    AuxLosses,
    attach_aux_loss,
    collect_aux_losses,
    set_aux_loss_group,
    update_expert_bias,
)
from dtensor_moe.moe.config import MoEConfig
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.losses import global_aux_loss_from_sums, router_losses, z_loss
from dtensor_moe.moe.protocol import Router, RouterLossSettings
from dtensor_moe.moe.shared import SharedExperts
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
    "LayerLoad",
    "MoE",
    "MoEConfig",
    "Router",
    "RouterLossSettings",
    "RouterOutput",
    "SharedExperts",
    "TokenChoiceTopKRouter",
    "attach_aux_loss",
    "collect_aux_losses",
    "aux_loss_from_sums",
    "global_aux_loss_from_sums",
    "load_stats",
    "router_losses",
    "sequence_aux_loss",
    "sequence_sums",
    "set_aux_loss_group",
    "set_router_loss_scale",
    "update_expert_bias",
    "z_loss",
]
