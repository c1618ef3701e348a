"""Fused optimizers across meshes and mixed-mesh gradient clipping."""

from dtensor_moe.optim.clip import clip_grad_norm_
from dtensor_moe.optim.fused import register_strategies

__all__ = ["clip_grad_norm_", "register_strategies"]
