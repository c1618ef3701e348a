"""Fused optimizers across meshes, mixed-mesh gradient clipping, and Muon across meshes."""

from dtensor_moe.optim.clip import clip_grad_norm_
from dtensor_moe.optim.fused import register_strategies
from dtensor_moe.optim.muon import Muon, MuonParamGroups, muon_param_groups
from dtensor_moe.optim.scaler import GradScaler

__all__ = [
    "GradScaler",
    "Muon",
    "MuonParamGroups",
    "clip_grad_norm_",
    "muon_param_groups",
    "register_strategies",
]
