"""The gradients of the mean loss over the global batch, for any layout: :func:`reduce_gradients`.

Note [Gradient bookkeeping across data-parallel ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each data-parallel rank (each pipeline under pipeline parallelism) takes the mean loss over its
own rows. The gradient of the mean over the global batch is the mean of those ranks' gradients:

* **Dense params** (everything outside the routed experts): each of the ``dp`` ranks of a stage
  holds its own gradient, so it is summed over the dense mesh's ``"dp"`` dim and divided by
  ``dp``. Tensor parallelism changes nothing there: the tp ranks of one dp rank share its rows,
  and DTensor already combined them.
* **Routed experts under expert parallelism** (DTensors on the expert mesh): the backward
  exchange already brought the gradient of every row that reached an expert, from every rank of
  its EP group, to the rank that holds it. What is missing is the other copies of the same
  expert: a sum over ``"edp"`` (when ``edp > 1``); then, as the ep ranks took their losses over
  ``dp`` different row sets, a division by ``dp``. The same factors as FSDP2's for the experts
  (``set_gradient_divide_factor(dp)`` on ``"edp"`` in ``fsdp.py``).
* **Params that FSDP2 manages** (a DTensor on a mesh with a ``"dp"`` or ``"edp"`` dim): FSDP2
  reduce-scattered and divided the gradient in backward already; nothing to do.

A gradient whose placements differ from its param's (a ``Partial`` one) is redistributed to the
param's placements first, as the optimizers need. A param whose gradient is reduced is marked
with its gradient tensor (a weak reference, not its ``id``: a gradient assigned after the old
one is freed often takes the old one's address, and so its ``id``) and that tensor's version.
A backward clears the mark: through the param's post-accumulate-grad hook, or (the zero-bubble
schedules' weight pass, which assigns or adds into ``param.grad`` itself) by a new gradient
tensor or a new version. A second call with no backward in between finds the mark and raises,
on every rank alike, before any collective: the gradients would otherwise be divided twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.parallel.mesh import MoEMeshes, require_meshes

__all__ = ["reduce_gradients"]

_FSDP_DIMS = frozenset({"dp", "edp"})
_EXPERT_DIMS = frozenset({"edp", "ep", "etp"})
_MARK = "_dtensor_moe_grad_reduced"  # on a param: the _grad_state it was reduced in, or None


def _modules(modules: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    if isinstance(modules, nn.Module):
        return [modules]
    out = list(modules)
    bad = [type(m).__name__ for m in out if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(
            f"reduce_gradients takes a module or an iterable of modules (a rank's stage "
            f"modules), got {bad[0]}"
        )
    return out


def _kind(param: torch.Tensor) -> str:
    """``"fsdp"``, ``"expert"`` or ``"dense"``: Note [Gradient bookkeeping across data-parallel
    ranks]."""
    if not isinstance(param, DTensor):
        return "dense"
    names = frozenset(param.device_mesh.mesh_dim_names or ())
    if names & _FSDP_DIMS:
        return "fsdp"
    return "expert" if names and names <= _EXPERT_DIMS else "dense"


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _grad_state(param: torch.Tensor) -> tuple[weakref.ref, int]:
    """Which gradient tensor ``param`` holds (a weak reference: a new tensor can take a freed
    one's ``id``), and its version: both change when a backward writes a new gradient or adds
    into the old one in place."""
    return weakref.ref(param.grad), _local(param.grad)._version


def _backward_wrote(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: a backward wrote to ``param.grad`` since the last reduction."""
    setattr(param, _MARK, None)


def _mark_reduced(param: torch.Tensor) -> None:
    if not hasattr(param, _MARK):  # the first reduction of this param: watch its backwards
        param.register_post_accumulate_grad_hook(_backward_wrote)
    setattr(param, _MARK, _grad_state(param))


def _reduced(param: torch.Tensor) -> bool:
    mark = getattr(param, _MARK, None)
    if mark is None:
        return False
    grad, version = mark
    return grad() is param.grad and version == _local(param.grad)._version


@torch.no_grad()
def reduce_gradients(modules: nn.Module | Iterable[nn.Module], meshes: MoEMeshes) -> None:
    """Make every gradient of ``modules`` that of the mean loss over the global batch.

    Call it once per optimizer step, after the backward (after ``schedule.step`` under pipeline
    parallelism) and before grad clipping, on every rank, with the modules of this rank (its
    stage modules under pipeline parallelism). It works at every layout of
    :func:`~dtensor_moe.parallel.build_moe_meshes`, with or without FSDP2 and pipeline
    parallelism; see Note [Gradient bookkeeping across data-parallel ranks].

    Args:
        modules: a module or an iterable of modules (several stage modules per rank).
        meshes: the :class:`~dtensor_moe.parallel.MoEMeshes` of this rank (of its stage).

    Collectives: one ``all_reduce`` over the dense mesh's ``"dp"`` ranks for the dense grads
    (when ``dp > 1`` and any is not managed by FSDP2) and one over ``"edp"`` for the routed
    experts' grads (when ``edp > 1``), each per grad dtype; plus a ``redistribute`` for each
    gradient whose placements differ from its param's. None for grads FSDP2 reduced.

    Raises:
        TypeError: ``meshes`` is not an :class:`MoEMeshes`, or ``modules`` holds a non-module.
        ValueError: the gradients were already reduced since the last backward (a second call
            in one step). Decided on every rank before any collective.
    """
    meshes = require_meshes(meshes, "reduce_gradients")
    named = [(n, p) for m in _modules(modules) for n, p in m.named_parameters()]
    params = [p for _, p in named if p.grad is not None]
    again = [n for n, p in named if p.grad is not None and _reduced(p)]
    if again:
        raise ValueError(
            f"reduce_gradients: the gradients of {again[:3]}{' ...' if len(again) > 3 else ''} "
            "were already reduced and no backward has written to them since; call it once per "
            "optimizer step, after the backward (a second call would divide them by dp again)"
        )
    buckets: dict[tuple[str, torch.dtype, torch.device], list[torch.Tensor]] = {}
    reduced = []
    for param in params:
        kind = _kind(param)
        if kind == "fsdp":
            continue
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        local = _local(param.grad)
        buckets.setdefault((kind, local.dtype, local.device), []).append(local)
        reduced.append(param)
    groups = {
        "dense": meshes.dense.get_group("dp") if meshes.dp > 1 else None,
        "expert": meshes.expert.get_group("edp") if meshes.edp > 1 else None,
    }
    for (kind, _, _), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if groups[kind] is not None:
            dist.all_reduce(flat, group=groups[kind])
        flat /= meshes.dp
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))
    for param in reduced:
        _mark_reduced(param)
