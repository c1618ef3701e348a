"""Fused optimizers across meshes and mixed-mesh gradient clipping."""

from dtensor_moe.optim.clip import clip_grad_norm_
from dtensor_moe.optim.fused import fast_paths_enabled, register_strategies, set_fast_paths

__all__ = ["clip_grad_norm_", "fast_paths_enabled", "register_strategies", "set_fast_paths"]
