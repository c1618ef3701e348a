"""dtensor_moe: DTensor extensions for Mixture-of-Experts training.

Importing the package registers DTensor handlers for every fused optimizer op (Adam, AdamW,
SGD, Adagrad; in-place, out-of-place, ``tensor_lr`` and ``.out`` overloads) and makes
``torch.amp.GradScaler`` agree on skip-or-step across meshes. See ``docs/optimizers.md``.
"""

from dtensor_moe.moe import MoE, MoEConfig
from dtensor_moe.optim import clip_grad_norm_, register_strategies
from dtensor_moe.parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    MoEMeshes,
    PrepareMoEInput,
    build_moe_meshes,
    fully_shard_moe,
    parallelize_moe,
)

__all__ = [
    "ExpertParallel",
    "ExpertTensorParallel",
    "MoE",
    "MoEConfig",
    "MoEMeshes",
    "PrepareMoEInput",
    "build_moe_meshes",
    "clip_grad_norm_",
    "fully_shard_moe",
    "parallelize_moe",
    "register_strategies",
]

register_strategies()
