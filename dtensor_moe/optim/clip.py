"""Gradient-norm clipping for grads that live on any mix of device meshes and placements.

``torch.nn.utils.clip_grad_norm_`` stacks one norm per grad, which fails as soon as the grads
sit on two different meshes. :func:`clip_grad_norm_` here computes the same total norm from the
local shards instead and returns it as a plain tensor, equal on every rank.

Note [Count each element once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For a p-norm (``0 < p < inf``) the total is ``(sum over all elements |x|^p)^(1/p)``, and the sum
can be split into any partition of the elements. So each rank folds the p-th powers of the norms
of its local shards, and the folds are summed over the mesh (``max`` instead of sum for ``inf``).
Every element of every full grad must enter that sum exactly once:

* ``Shard`` mesh dims split a grad into disjoint pieces: their folds are all-reduced over that
  mesh dim. Uneven shards (7 rows over 4 ranks) need nothing special, and an empty shard adds 0.
* ``Replicate`` mesh dims hold copies. When a mesh dim is reduced for the sake of other grads on
  the same mesh, only the rank at coordinate 0 of that dim counts the copy; the others add 0.
  Exact, no rescaling.
* ``Partial`` grads hold summands, and the norm of a sum is not a sum of norms. Their local
  shards are reduced first (one all-reduce per Partial mesh dim for each group of Partial grads
  with the same mesh, placements and dtype, flattened into one buffer), which makes that dim
  behave like ``Replicate`` for the norm. The grads themselves stay ``Partial``; scaling the
  summands by the clip coefficient ``c >= 0`` scales their reduction by ``c``.
* Plain tensors are taken as they are on each rank, counted once, with no collective, exactly
  like ``torch.nn.utils.clip_grad_norm_``. They are assumed identical on every rank; if they
  are not, the total norm differs across ranks.

Each mesh then all-reduces one 2-element fold ``[value, nan_count]`` once per mesh dim that some
grad on it shards (sum, or max for ``inf``). The nan count keeps a ``nan`` from being dropped by a
backend's max. After that every rank holds the reduced fold of every mesh its grads live on, so
the meshes are combined locally, with no further communication.

Collectives: per mesh, one ``all_reduce`` for each mesh dim that some grad on the mesh carries as
``Shard`` (none for a mesh whose grads are all replicated), plus one ``all_reduce`` per Partial
mesh dim for each (mesh, placements, dtype) group of ``Partial`` grads. A 1-D mesh of sharded
grads costs one all-reduce, a 2-D mesh at most two, whatever the number of grads.

Every grad's mesh must contain the calling rank. A grad on a mesh without this rank raises
``ValueError`` on that rank before any collective. That check is local, so the ranks that are in
the mesh are not told: pass each rank only the params it holds (as pipeline stages do). With
pipeline stages the result is the norm of this stage's grads; combining stages is up to the
caller.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from dtensor_moe._compat import device_has_foreach_support, local_tensor, splits_tensor

__all__ = ["clip_grad_norm_"]

# ``Partial.reduce_op`` -> how to all-reduce the summands. "avg" is a sum divided by the group
# size afterwards, because gloo has no AVG. Only ops with reduce(c * a_i) = c * reduce(a_i) for
# c >= 0 are listed, so that scaling the summands scales the grad ("product" is not).
_PARTIAL_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

_NONFINITE_MESSAGE = (
    "The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
    "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
    "anyway, set `error_if_nonfinite=False`"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class _NormSpec:
    """What every fold needs: the norm order, the accumulation dtype and the result device."""

    p: float
    acc_dtype: torch.dtype
    device: torch.device
    foreach: bool | None

    @property
    def is_inf(self) -> bool:
        return math.isinf(self.p)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the total gradient norm of ``parameters`` in place, across any meshes.

    Same contract as :func:`torch.nn.utils.clip_grad_norm_`, computed as if every grad were
    gathered to one device: the total norm is the ``norm_type``-norm of all grad elements, and
    every grad is multiplied in place by ``min(max_norm / (total + 1e-6), 1)``. Grads may be plain
    tensors or DTensors on any number of meshes, with any mix of ``Shard`` (even or not),
    ``Replicate`` and ``Partial``. Params without a grad are skipped.

    Collectives: ``all_reduce`` only; per mesh, one for each mesh dim that some grad on it shards,
    plus one per Partial mesh dim per (mesh, placements, dtype) group of ``Partial`` grads. See
    Note [Count each element once]. Plain tensors need none.

    Args:
        parameters: a tensor or an iterable (a generator too) of tensors whose ``.grad`` to clip.
        max_norm: the largest allowed total norm, ``>= 0`` (``inf`` computes the norm only).
        norm_type: the order ``p`` of the norm, a number ``> 0`` or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total norm is
            ``nan`` or ``inf`` instead of scaling the grads by it.
        foreach: ``None`` uses the foreach kernels where the device supports them; ``True``
            requires them (``RuntimeError`` otherwise); ``False`` loops over the grads.

    Returns:
        The total norm as a plain 0-dim tensor on the first grad's device, equal on every rank;
        ``tensor(0.0)`` when no param has a grad.

    Raises:
        TypeError: a param that is not a tensor, or a non-numeric ``max_norm``/``norm_type``.
        ValueError: ``norm_type <= 0`` or ``nan``; ``max_norm < 0`` or ``nan``; a grad on a mesh
            without this rank; a ``Partial`` reduce op other than sum/avg/max/min.

    Example::

        >>> loss.backward()
        >>> total = dtensor_moe.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    params = _as_param_list(parameters)
    max_norm_f = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    _check_grads(params, foreach)
    total = _total_norm(grads, _norm_spec(grads, p, foreach))
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(_NONFINITE_MESSAGE.format(norm_type=p))
    _scale_grads_(grads, torch.clamp(max_norm_f / (total + 1e-6), max=1.0), foreach)
    return total


# --- validation (all local: it runs before the first collective, identically on every rank) ---


def _as_param_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """A list of the params; warns like torch on an empty generator."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    params = list(parameters)
    if is_generator and not params:
        warnings.warn(
            "`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=4
        )
    for i, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"clip_grad_norm_: parameters[{i}] is a {type(param).__name__}, not a tensor; "
                "pass tensors (for example model.parameters())"
            )
    return params


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool):
        raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"clip_grad_norm_: {name} must be a number (or 'inf'), got {value!r}"
        ) from None


def _check_max_norm(max_norm: object) -> float:
    value = _as_float("max_norm", max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"clip_grad_norm_: max_norm must be >= 0, got {max_norm!r}; a negative or nan "
            "max_norm would flip or erase every gradient"
        )
    return value


def _check_norm_type(norm_type: object) -> float:
    p = _as_float("norm_type", norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}; "
            "use 1, 2, float('inf') or any positive p"
        )
    return p


def _check_grads(params: list[torch.Tensor], foreach: bool | None) -> None:
    """Reject grads on meshes without this rank, unknown Partial ops and unsupported foreach."""
    for i, param in enumerate(params):
        grad = param.grad
        if not isinstance(grad, DTensor):
            continue
        if grad.device_mesh.get_coordinate() is None:
            raise ValueError(
                f"clip_grad_norm_: parameters[{i}].grad lives on {grad.device_mesh}, which does "
                f"not contain rank {dist.get_rank()}; pass each rank only the params on its meshes"
            )
        for placement in grad.placements:
            if placement.is_partial() and placement.reduce_op not in _PARTIAL_REDUCE_OPS:
                raise ValueError(
                    f"clip_grad_norm_: parameters[{i}].grad is Partial({placement.reduce_op!r}); "
                    f"supported reduce ops are {sorted(_PARTIAL_REDUCE_OPS)}. Redistribute it "
                    "to Replicate or Shard first"
                )
    if foreach:
        for device in {_local(p.grad).device for p in params if p.grad is not None}:
            if not device_has_foreach_support(device):
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} "
                    "tensors"
                )


def _norm_spec(grads: list[torch.Tensor], p: float, foreach: bool | None) -> _NormSpec:
    """Accumulate in at least fp32 (fp64 if any grad is fp64); report on the first grad's device."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    acc_dtype = torch.promote_types(dtype, torch.float32)
    return _NormSpec(p=p, acc_dtype=acc_dtype, device=_local(grads[0]).device, foreach=foreach)


# --- the total norm ---


def _local(grad: torch.Tensor) -> torch.Tensor:
    return local_tensor(grad) if isinstance(grad, DTensor) else grad


def _total_norm(grads: list[torch.Tensor], spec: _NormSpec) -> torch.Tensor:
    """Fold the plain grads locally and each mesh's grads over that mesh, then combine."""
    out_dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    by_mesh: dict[DeviceMesh, list[DTensor]] = {}
    plain: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            by_mesh.setdefault(grad.device_mesh, []).append(grad)
        else:
            plain.append(grad)
    folds = [_fold(plain, spec)] if plain else []
    folds += [_mesh_fold(mesh, group, spec).to(spec.device) for mesh, group in by_mesh.items()]
    stacked = torch.stack(folds)
    value = stacked[:, 0].amax() if spec.is_inf else stacked[:, 0].sum().pow(1.0 / spec.p)
    value = torch.where(stacked[:, 1].sum() > 0, torch.full_like(value, math.nan), value)
    return value.to(out_dtype)


def _fold(tensors: list[torch.Tensor], spec: _NormSpec) -> torch.Tensor:
    """``[sum of norm^p (max of norms for inf), number of nan norms]`` of ``tensors``, locally."""
    norms = _local_norms([t for t in tensors if t.numel() > 0], spec)
    if norms.numel() == 0:
        return torch.zeros(2, dtype=spec.acc_dtype, device=spec.device)
    value = norms.amax() if spec.is_inf else norms.pow(spec.p).sum()
    return torch.stack([value, norms.isnan().sum().to(spec.acc_dtype)])


def _local_norms(tensors: list[torch.Tensor], spec: _NormSpec) -> torch.Tensor:
    """One norm per tensor in ``spec.acc_dtype`` on ``spec.device``; foreach per (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    norms: list[torch.Tensor] = []
    for (device, _), group in groups.items():
        if _use_foreach(group, device, spec.foreach):
            norms += torch._foreach_norm(group, spec.p, dtype=spec.acc_dtype)
        else:
            norms += [torch.linalg.vector_norm(t, spec.p, dtype=spec.acc_dtype) for t in group]
    if not norms:
        return torch.zeros(0, dtype=spec.acc_dtype, device=spec.device)
    return torch.stack([n.to(spec.device) for n in norms])


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: ``None`` -> foreach for plain tensors on a supporting device."""
    if foreach is None:
        return device_has_foreach_support(device) and all(type(t) is torch.Tensor for t in tensors)
    return foreach


def _mesh_fold(mesh: DeviceMesh, grads: list[DTensor], spec: _NormSpec) -> torch.Tensor:
    """The fold of ``grads`` over all of ``mesh``: all-reduce once per mesh dim that is sharded."""
    entries = _norm_entries(mesh, grads)
    reduce_dims = sorted({d for _, pl in entries for d, p in enumerate(pl) if splits_tensor(p)})
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "checked in _check_grads"
    owned = [
        local
        for local, placements in entries
        if all(coordinate[d] == 0 or splits_tensor(placements[d]) for d in reduce_dims)
    ]
    fold = _fold(owned, spec)
    op = dist.ReduceOp.MAX if spec.is_inf else dist.ReduceOp.SUM
    for d in reduce_dims:
        dist.all_reduce(fold, op=op, group=mesh.get_group(d))
    return fold


def _norm_entries(
    mesh: DeviceMesh, grads: list[DTensor]
) -> list[tuple[torch.Tensor, tuple[Placement, ...]]]:
    """(local tensor, placements) pairs whose local norms partition the grads' elements.

    Grads without ``Partial`` pass through. ``Partial`` grads are grouped by (placements, dtype),
    flattened into one buffer per group and reduced over their Partial mesh dims (one
    ``all_reduce`` per Partial dim per group); the buffer then counts as ``Replicate`` there.
    """
    entries: list[tuple[torch.Tensor, tuple[Placement, ...]]] = []
    partial_groups: dict[tuple[tuple[Placement, ...], torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        placements = tuple(grad.placements)
        if any(p.is_partial() for p in placements):
            partial_groups.setdefault((placements, grad.dtype), []).append(local_tensor(grad))
        else:
            entries.append((local_tensor(grad), placements))
    for (placements, _), locals_ in partial_groups.items():
        buffer = torch.cat([t.reshape(-1) for t in locals_])
        _reduce_partial_dims_(buffer, mesh, placements)
        entries.append((buffer, tuple(Replicate() if p.is_partial() else p for p in placements)))
    return entries


def _reduce_partial_dims_(
    buffer: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> None:
    """Reduce ``buffer`` in place over each ``Partial`` mesh dim (one ``all_reduce`` each)."""
    for d, placement in enumerate(placements):
        if not isinstance(placement, Partial):
            continue
        op = _PARTIAL_REDUCE_OPS[placement.reduce_op]
        dist.all_reduce(buffer, op=op, group=mesh.get_group(d))
        if placement.reduce_op == "avg":
            buffer.div_(mesh.size(d))


# --- clipping ---


def _scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Multiply every grad's local tensor by ``coef`` in place, foreach per (device, dtype).

    No collective: a shard, a replica or a Partial summand scaled by ``coef >= 0`` is the same
    piece of the scaled full grad.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in groups.items():
        coef_on_device = coef.to(device)
        if _use_foreach(group, device, foreach):
            torch._foreach_mul_(group, coef_on_device)
        else:
            for t in group:
                t.mul_(coef_on_device)
