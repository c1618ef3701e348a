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
the mesh are not told: pass each rank only the params it holds (as pipeline stages do).

Note [Norm across pipeline stages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under pipeline parallelism each rank holds the params of its stage only, so the fold above,
combined over the rank's meshes, is the fold of its stage. With ``pp_mesh`` (the ranks at this
rank's position in every stage: one rank per stage) the stage folds are combined by one more
``all_reduce`` over ``pp_mesh``: the sum of the p-th powers (``max`` for ``inf``) and the nan
count, before the p-th root. Every element of the model is then counted once: once in its stage
(above) and each stage once over ``pp_mesh``. That is why ``pp_mesh`` must hold one rank per
stage, and may share no rank but this one with the meshes of the grads.

Whether it does is decided alike on every rank, never from the grads one rank happens to hold
(a stage of plain-tensor grads sees no mesh, and deciding there alone would leave it waiting in
the all-reduce that the other stage refused to join):

* with ``meshes=`` (the :class:`~dtensor_moe.parallel.MoEMeshes` of this stage), before any
  collective: ``pp_mesh`` (default ``meshes.pp_mesh``) must hold ``meshes.pp`` ranks, one in each
  stage's ranks. Every rank sees the same layout and raises the same ``ValueError``.
* without it, a rank whose grads' meshes share a rank other than itself with ``pp_mesh`` skips
  its stage fold and raises only after the all-reduce over ``pp_mesh``, which carries one more
  slot: the number of ranks that found such a mesh. Every rank of ``pp_mesh`` then raises
  ``ValueError`` together, the rank without meshes too, and no grad is scaled.

The same all-reduce carries one flag per grad dtype in ``_FLAGGED_DTYPES``, so every rank
returns the total in the promoted dtype of every stage's grads, as torch would on the gathered
grads; reading the flags back is one device-to-host copy. The buffer is fp64: stages may
accumulate in different dtypes (fp32, or fp64 for fp64 grads), and the buffer must be the same
on every rank. A rank whose stage holds no grad joins with a zero fold, and every rank then
holds the same total, so ``error_if_nonfinite`` raises on every rank or on none, and the clip
coefficient is the same everywhere.
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
from dtensor_moe.parallel.mesh import MoEMeshes, require_meshes

__all__ = ["clip_grad_norm_"]

# The grad dtypes that the all-reduce over ``pp_mesh`` flags, in a fixed order (the same on
# every rank); see Note [Norm across pipeline stages].
_FLAGGED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

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


@dataclass(frozen=True, kw_only=True, slots=True)
class _PipelineGroup:
    """The group that ``pp_mesh`` names, checked: it contains this rank (and, with ``meshes=``,
    one rank of each stage)."""

    group: dist.ProcessGroup
    ranks: frozenset[int]
    device: torch.device  # where the all-reduce buffer lives
    label: str  # for error messages


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | dist.ProcessGroup | None = None,
    meshes: MoEMeshes | None = None,
) -> torch.Tensor:
    """Clip the total gradient norm of ``parameters`` in place, across any meshes and stages.

    Same contract as :func:`torch.nn.utils.clip_grad_norm_`, computed as if every grad were
    gathered to one device: the total norm is the ``norm_type``-norm of all grad elements, and
    every grad is multiplied in place by ``min(max_norm / (total + 1e-6), 1)``. Grads may be plain
    tensors or DTensors on any number of meshes, with any mix of ``Shard`` (even or not),
    ``Replicate`` and ``Partial``. Params without a grad are skipped.

    Under pipeline parallelism pass ``meshes`` (or ``pp_mesh``): the total is then the norm over
    the grads of every stage, and every rank of every stage must call this function (a rank
    whose stage has no grad too).

    Collectives: ``all_reduce`` only; per mesh, one for each mesh dim that some grad on it shards,
    plus one per Partial mesh dim per (mesh, placements, dtype) group of ``Partial`` grads. See
    Note [Count each element once]. Plain tensors need none. With ``pp_mesh``, one more over
    ``pp_mesh`` (Note [Norm across pipeline stages]).

    Args:
        parameters: a tensor or an iterable (a generator too) of tensors whose ``.grad`` to clip.
        max_norm: the largest allowed total norm, ``>= 0`` (``inf`` computes the norm only).
        norm_type: the order ``p`` of the norm, a number ``> 0`` or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total norm is
            ``nan`` or ``inf`` instead of scaling the grads by it.
        foreach: ``None`` uses the foreach kernels where the device supports them; ``True``
            requires them (``RuntimeError`` otherwise); ``False`` loops over the grads.

    Keyword Args:
        pp_mesh: ``None`` (the default): the norm of the grads passed on this rank's meshes, as
            without pipeline parallelism. Else the ranks at this rank's position in every
            pipeline stage, one rank per stage: the 1-D ``meshes.pp_mesh`` of
            :func:`~dtensor_moe.build_moe_meshes` (``None`` when ``pp == 1``), or the
            ``ProcessGroup`` of those ranks. The stages' norms are combined over it.
        meshes: this stage's :class:`~dtensor_moe.parallel.MoEMeshes`: ``pp_mesh`` defaults to
            ``meshes.pp_mesh`` (no pipeline parallelism when ``meshes.pp == 1``), and a given
            ``pp_mesh`` is checked against the stage layout before any collective (Note [Norm
            across pipeline stages]).

    Returns:
        The total norm as a plain 0-dim tensor on the first grad's device, equal on every rank;
        ``tensor(0.0)`` when no param has a grad. With ``pp_mesh``: the norm over every stage,
        in the promoted dtype of every stage's grads, on every rank (on the device of
        ``pp_mesh`` where this rank has no grad).

    Raises:
        TypeError: a param that is not a tensor, or a non-numeric ``max_norm``/``norm_type``;
            a ``pp_mesh`` that is not a ``DeviceMesh`` or ``ProcessGroup``.
        ValueError: ``norm_type <= 0`` or ``nan``; ``max_norm < 0`` or ``nan``; a grad on a mesh
            without this rank; a ``Partial`` reduce op other than sum/avg/max/min; a
            ``pp_mesh`` that is not 1-D or does not contain this rank; with ``meshes``, a
            ``pp_mesh`` that is not one rank per stage; without it, a ``pp_mesh`` that shares
            another rank with a grad's mesh on some rank (on every rank of ``pp_mesh``, after
            its all-reduce).

    Example::

        >>> loss.backward()
        >>> total = dtensor_moe.clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> # under pipeline parallelism, on every rank of every stage:
        >>> total = dtensor_moe.clip_grad_norm_(stage.parameters(), 1.0, meshes=meshes)
    """
    params = _as_param_list(parameters)
    max_norm_f = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    pp = _check_pp_mesh(pp_mesh, meshes)
    grads = [param.grad for param in params if param.grad is not None]
    if not grads and pp is None:
        return torch.tensor(0.0)
    _check_grads(params, foreach, () if pp is None else (pp.device,))
    overlap = None if pp is None else _pp_overlap(params, pp)
    total = _total_norm(grads, p, foreach, pp, overlap)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(_NONFINITE_MESSAGE.format(norm_type=p))
    if grads:
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


def _check_grads(
    params: list[torch.Tensor], foreach: bool | None, devices: tuple[torch.device, ...]
) -> None:
    """Reject grads on meshes without this rank, unknown Partial ops and unsupported foreach.

    ``foreach=True`` is checked on the grads' devices and on ``devices``: with ``pp_mesh``, the
    device of its collective, so that a rank whose stage holds no grad decides as the others
    (the device type is the same on every rank of an SPMD program).
    """
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
        for device in {_local(p.grad).device for p in params if p.grad is not None}.union(devices):
            if not device_has_foreach_support(device):
                raise RuntimeError(
                    f"foreach=True was passed, but can't use the foreach API on {device.type} "
                    "tensors"
                )


def _check_pp_mesh(pp_mesh: object, meshes: object) -> _PipelineGroup | None:
    """``pp_mesh`` (default ``meshes.pp_mesh``) as a checked group: 1-D if a mesh, containing this
    rank, and with ``meshes`` one rank per stage. Local, no collective."""
    if meshes is not None:
        meshes = require_meshes(meshes, "clip_grad_norm_")
        if pp_mesh is None:
            pp_mesh = meshes.pp_mesh
        elif meshes.pp == 1:
            raise ValueError(
                f"clip_grad_norm_: pp_mesh={pp_mesh!r} was given with meshes of one pipeline "
                "stage (meshes.pp == 1); leave pp_mesh out"
            )
    if pp_mesh is None:
        return None
    pp = _as_group(pp_mesh)
    if meshes is not None:
        _check_against_stages(pp, meshes)
    return pp


def _as_group(pp_mesh: object) -> _PipelineGroup:
    """``pp_mesh`` as a group: 1-D if a mesh, containing this rank."""
    rank = dist.get_rank()
    if isinstance(pp_mesh, DeviceMesh):
        if pp_mesh.ndim != 1:
            raise ValueError(
                f"clip_grad_norm_: pp_mesh must be a 1-D DeviceMesh, got {pp_mesh} "
                f"({pp_mesh.ndim}-D); pass meshes.pp_mesh from build_moe_meshes(pp=...), or "
                "the 1-D slice of your mesh's pipeline dim (mesh['pp'])"
            )
        ranks = frozenset(pp_mesh.mesh.flatten().tolist())
        device = _device_of_type(pp_mesh.device_type)
        group = pp_mesh.get_group() if rank in ranks else None
    elif isinstance(pp_mesh, dist.ProcessGroup):
        ranks = frozenset(dist.get_process_group_ranks(pp_mesh))
        device = _device_of_type("cpu" if dist.get_backend(pp_mesh) == "gloo" else _accelerator())
        group = pp_mesh
    elif type(pp_mesh) is int and pp_mesh == dist.GroupMember.NON_GROUP_MEMBER:
        ranks, device, group = frozenset(), torch.device("cpu"), None
    else:
        raise TypeError(
            f"clip_grad_norm_: pp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None, got "
            f"{type(pp_mesh).__name__} {pp_mesh!r}; pass meshes.pp_mesh from "
            "build_moe_meshes(pp=...)"
        )
    if rank not in ranks or group is None:
        raise ValueError(
            f"clip_grad_norm_: pp_mesh {pp_mesh!r} does not contain rank {rank}; pass this "
            "rank's own pp mesh (meshes.pp_mesh of build_moe_meshes(pp=...) on this rank)"
        )
    return _PipelineGroup(group=group, ranks=ranks, device=device, label=repr(pp_mesh))


def _accelerator() -> str:
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def _device_of_type(device_type: str) -> torch.device:
    """The current device of ``device_type`` (``cuda:<current>``), where a collective runs."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _check_against_stages(pp: _PipelineGroup, meshes: MoEMeshes) -> None:
    """Reject a ``pp_mesh`` that is not one rank of each of ``meshes.pp`` stages; every rank
    sees the same layout, so every rank decides alike (Note [Norm across pipeline stages])."""
    stage_size = len(meshes.stage_ranks)
    stages = sorted(r // stage_size for r in pp.ranks)
    if stages == list(range(meshes.pp)):
        return
    raise ValueError(
        f"clip_grad_norm_: pp_mesh {pp.label} holds ranks {sorted(pp.ranks)}, of stages "
        f"{stages}, but a pp_mesh is one rank of each of the meshes' {meshes.pp} stages of "
        f"{stage_size} ranks (this stage: ranks {list(meshes.stage_ranks)}); leave pp_mesh out "
        "and pass meshes=meshes, or pass meshes.pp_mesh"
    )


def _pp_overlap(params: list[torch.Tensor], pp: _PipelineGroup) -> str | None:
    """Why ``pp_mesh`` is wrong as seen from this rank's grads, or ``None``: it shares a rank
    other than this one with a grad's mesh.

    Such a group is not one rank per stage (the stage group or the world, say), and the
    all-reduce over it would count the grads of those ranks' meshes more than once. Other ranks
    may not see it (their grads may be plain tensors), so the finding travels with the
    all-reduce over ``pp_mesh`` and every rank raises after it (Note [Norm across pipeline
    stages]).
    """
    rank = dist.get_rank()
    seen: set[DeviceMesh] = set()
    for i, param in enumerate(params):
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.device_mesh in seen:
            continue
        seen.add(grad.device_mesh)
        shared = (set(grad.device_mesh.mesh.flatten().tolist()) & pp.ranks) - {rank}
        if shared:
            return (
                f"on rank {rank} it shares ranks {sorted(shared)} with {grad.device_mesh}, the "
                f"mesh of parameters[{i}].grad"
            )
    return None


def _norm_spec(grads: list[torch.Tensor], p: float, foreach: bool | None) -> _NormSpec:
    """Accumulate in at least fp32 (fp64 if any grad is fp64); report on the first grad's device."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    acc_dtype = torch.promote_types(dtype, torch.float32)
    return _NormSpec(p=p, acc_dtype=acc_dtype, device=_local(grads[0]).device, foreach=foreach)


# --- the total norm ---


def _local(grad: torch.Tensor) -> torch.Tensor:
    return local_tensor(grad) if isinstance(grad, DTensor) else grad


def _total_norm(
    grads: list[torch.Tensor],
    p: float,
    foreach: bool | None,
    pp: _PipelineGroup | None,
    overlap: str | None = None,
) -> torch.Tensor:
    """The total norm of this stage's ``grads``, or of every stage's over ``pp``.

    ``overlap``: why this rank found ``pp`` wrong (:func:`_pp_overlap`); it then joins the
    all-reduce over ``pp`` with nothing else, and every rank of ``pp`` raises after it.
    """
    dtypes = [g.dtype for g in grads]
    if grads and overlap is None:
        spec = _norm_spec(grads, p, foreach)
        fold, device = _stage_fold(grads, spec), spec.device
    else:  # pp is not None: join the all-reduce over pp with nothing to add
        fold, device = torch.zeros(2, dtype=torch.float64, device=pp.device), pp.device
    if pp is not None:
        fold, dtypes = _reduce_over_pp(fold, dtypes, p, pp, overlap)
    value = fold[0] if math.isinf(p) else fold[0].pow(1.0 / p)
    value = torch.where(fold[1] > 0, torch.full_like(value, math.nan), value)
    out_dtype = torch.get_default_dtype()  # torch's tensor(0.0) when no stage has a grad
    if dtypes:
        out_dtype = functools.reduce(torch.promote_types, dtypes)
    return value.to(device=device, dtype=out_dtype)


def _stage_fold(grads: list[torch.Tensor], spec: _NormSpec) -> torch.Tensor:
    """The fold of the plain grads (locally) and of each mesh's grads (over that mesh), combined:
    ``[sum of p-th powers (max for inf), nan count]`` of every grad passed on this rank's meshes.
    """
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
    value = stacked[:, 0].amax() if spec.is_inf else stacked[:, 0].sum()
    return torch.stack([value, stacked[:, 1].sum()])


def _reduce_over_pp(
    fold: torch.Tensor,
    dtypes: list[torch.dtype],
    p: float,
    pp: _PipelineGroup,
    overlap: str | None,
) -> tuple[torch.Tensor, list[torch.dtype]]:
    """Combine the stages' folds and grad dtypes with one ``all_reduce`` over ``pp``.

    See Note [Norm across pipeline stages]: ``[value, nan count, wrong-pp_mesh count, one flag
    per flagged dtype]`` in fp64, summed (``max`` for ``inf``: a flag or a count stays > 0 under
    both). Raises ``ValueError`` on every rank when some rank found ``pp`` wrong.
    """
    flags = [1.0 if overlap else 0.0] + [1.0 if d in dtypes else 0.0 for d in _FLAGGED_DTYPES]
    buffer = torch.cat([
        fold.to(device=pp.device, dtype=torch.float64),
        torch.tensor(flags, dtype=torch.float64, device=pp.device),
    ])
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(buffer, op=op, group=pp.group)
    wrong, *present = buffer[2:].tolist()
    if wrong > 0:
        raise ValueError(
            f"clip_grad_norm_: pp_mesh {pp.label} is not one rank per pipeline stage: "
            f"{overlap or 'on another rank it shares ranks with the mesh of a grad'}, so grads "
            "would be counted more than once. Pass meshes=meshes (this stage's MoEMeshes), or "
            "pp_mesh=meshes.pp_mesh from build_moe_meshes(pp=...)"
        )
    everywhere = [d for d, flag in zip(_FLAGGED_DTYPES, present, strict=True) if flag > 0]
    return buffer[:2], everywhere + [d for d in dtypes if d not in _FLAGGED_DTYPES]


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
