"""GradScaler support: one skip-or-step decision on every rank, whatever the meshes.

Note [GradScaler across meshes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.amp.GradScaler`` checks grads for inf/nan with
``aten._amp_foreach_non_finite_check_and_unscale_``, once per (device, dtype) group, and feeds
the resulting ``found_inf`` to the fused optimizer, which skips the step when it is non-zero.
torch 2.13's DTensor handler for that op reduces ``found_inf`` over the mesh of the *first* grad
only. When grads live on several meshes, an inf that appears on a rank outside that mesh's
group is missed by the others: ranks disagree, some step and some skip, and the replicas drift
apart silently.

Our handler runs the check on every grad's local tensor, then max-reduces ``found_inf`` over all
ranks that hold any of the grads:

* when those meshes together cover the whole default process group (the usual SPMD case), one
  all-reduce(max) over the default group;
* otherwise (for example one pipeline stage's meshes), an all-reduce(max) over every dimension
  of every mesh, repeated once per mesh so that the maximum crosses overlapping meshes.

The handler is installed by ``import dtensor_moe`` (see ``register_strategies``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat

__all__ = ["found_inf_handler", "register_found_inf_handler"]

_OP = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


@functools.cache
def _mesh_ranks(mesh) -> frozenset[int]:
    return frozenset(mesh.mesh.flatten().tolist())


def _distinct_meshes(grads: list) -> list:
    meshes = []
    for g in grads:
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if not any(mesh is m or mesh == m for m in meshes):
                meshes.append(mesh)
    return meshes


def _reduce_found_inf(found_inf: torch.Tensor, meshes: list) -> None:
    """Max-reduce ``found_inf`` in place so every rank holding one of ``meshes`` agrees."""
    ranks = frozenset().union(*(_mesh_ranks(m) for m in meshes))
    if len(ranks) == dist.get_world_size():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return
    for _ in range(len(meshes)):
        for mesh in meshes:
            if mesh.get_coordinate() is None:
                continue
            for dim in range(mesh.ndim):
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def found_inf_handler(op, args: tuple, kwargs: dict) -> None:
    """DTensor handler for ``_amp_foreach_non_finite_check_and_unscale_`` over mixed meshes.

    Communication: one all-reduce(max) of ``found_inf`` (see Note [GradScaler across meshes]).
    """
    grads, found_inf, inv_scale = args
    local_grads = [_compat.local_tensor(g) if isinstance(g, DTensor) else g for g in grads]
    if isinstance(found_inf, DTensor) or isinstance(inv_scale, DTensor):
        raise TypeError(
            "GradScaler's found_inf and inv_scale must be plain tensors, got "
            f"{type(found_inf).__name__} and {type(inv_scale).__name__}."
        )
    op(local_grads, found_inf, inv_scale, **kwargs)
    meshes = _distinct_meshes(grads)
    if meshes:
        _reduce_found_inf(found_inf, meshes)


def register_found_inf_handler() -> None:
    """Install :func:`found_inf_handler` as DTensor's handler for the inf check (idempotent)."""
    _compat.custom_op_handlers()[_OP] = found_inf_handler
