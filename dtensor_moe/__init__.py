"""dtensor_moe: DTensor extensions for Mixture-of-Experts training.

Importing the package registers DTensor handlers for every fused optimizer op (Adam, AdamW,
SGD, Adagrad; in-place, out-of-place, ``tensor_lr`` and ``.out`` overloads) and makes
``torch.amp.GradScaler`` agree on skip-or-step across meshes. See ``docs/optimizers.md``.
"""

from dtensor_moe import _compat
from dtensor_moe.moe import AuxLosses, MoE, MoEConfig, collect_aux_losses
from dtensor_moe.optim import clip_grad_norm_, register_strategies
from dtensor_moe.parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    MoEMeshes,
    PrepareMoEInput,
    build_moe_meshes,
    fully_shard_moe,
    parallelize_dense,
    parallelize_moe,
)

__all__ = [
    "AuxLosses",
    "ExpertParallel",
    "ExpertTensorParallel",
    "MoE",
    "MoEConfig",
    "MoEMeshes",
    "PrepareMoEInput",
    "build_moe_meshes",
    "clear_caches",
    "clip_grad_norm_",
    "collect_aux_losses",
    "fully_shard_moe",
    "parallelize_dense",
    "parallelize_moe",
    "register_strategies",
]


def clear_caches() -> None:
    """Empty every cache of dtensor_moe. No collective; safe at any time and on any rank.

    The caches only save work: each is rebuilt on the next call that needs it, with the same
    results. None of them keeps a mesh, a process group, an optimizer or a tensor alive beyond
    the objects it describes (each module's Note gives key, bound and lifetime), so calling this
    is not needed to free them; it releases the little they hold at once. Emptied:

    - ``dtensor_moe._compat._GRAD_SPECS``: gradient specs of ``local_views`` per DTensor spec
      (Note [Gradient-spec cache]).

    The fused optimizer handlers keep no cache (Note [Handler cost] in ``optim/fused.py``).
    State that belongs to one object lives on it, not here: whether ``update_expert_bias`` has
    warned about a module (an attribute of the module).

    Left alone: the memo of :func:`build_moe_meshes`, which holds its meshes weakly and must
    keep returning a mesh that is still in use (Note [Mesh memo]); the GradScaler handler's
    sequence counters, which are not a cache and must stay equal on every rank (Note [GradScaler
    across meshes]); torch's own caches (sharding propagation, redistribute plans), which hold
    the meshes of the specs they have seen.
    """
    _compat._GRAD_SPECS.clear()


register_strategies()
