"""Muon over params on any number of device meshes: dense matrices and routed experts.

Shape legend:
    m, n   rows and columns of one matrix (a 2-D param, or one expert of a 3-D param)
    e      local experts of a 3-D param (its dim 0 on this rank)

Note [Muon update]
~~~~~~~~~~~~~~~~~~
:class:`Muon` takes the arguments, defaults and update of ``torch.optim.Muon`` (torch 2.13):
per matrix, ``buf.lerp_(grad, 1 - momentum)``; the update ``grad.lerp(buf, momentum)``
(Nesterov) or ``buf``; Newton-Schulz on that update in bfloat16 (:func:`newton_schulz`;
``ns_dtype``, an addition of dtensor_moe, picks another dtype);
``param.mul_(1 - lr * weight_decay)`` and ``param.add_(ortho, alpha=-adjusted_lr)`` with the lr
scaled by the matrix's shape (``adjust_lr_fn``). Everything but Newton-Schulz is elementwise,
so it runs on the local shards as they are. A 3-D param ``(E, m, n)`` is ``E`` matrices, one per
routed expert, each orthogonalized and lr-adjusted as a matrix of shape ``(m, n)``.

Note [Owner assembly]
~~~~~~~~~~~~~~~~~~~~~
Newton-Schulz needs the whole matrix. Where a rank already holds whole matrices (a plain or
``Replicate`` param, experts split on their expert dim by EP) it runs on the local tensor and
no collective runs. A matrix split along one of its own dims (FSDP2's ``Shard(0)``, TP's
``Shard(0)``/``Shard(1)``, FSDP2's ``_StridedShard`` over TP, experts split on dim 1 or 2 by
FSDP2 on ``edp`` or expert TP on ``etp``) is assembled on **one owner rank** among the ranks
that share it (those that differ only in the mesh dims that split the matrix: its *gather
dims*), orthogonalized there, and its shards are sent back:

* owners: per group of params with the same mesh and gather dims (an *exchange*), matrices are
  dealt out greedily by Newton-Schulz cost (``m * n * min(m, n)``), largest first, to the
  least-loaded coordinate; every rank computes the same deal from the params' global shapes
  and placements alone.
* one exchange costs ``2 * len(gather dims)`` ``all_to_all_single`` calls, one per gather dim in
  each direction, over that mesh dim's process group, whatever the number of params in it.
  With two gather dims the matrix first comes together along the inner one, then along the
  outer one; no process group is created.
* what moves is the update in ``ns_dtype`` (Newton-Schulz casts to it first, so the cast on the
  sender gives the same bits), to the owner and back; what a rank keeps for itself stays out of
  the collective. With one gather dim of ``g`` ranks a matrix moves ``(g - 1) / g`` of its
  ``ns_dtype`` bytes each way; with two, ``(g_1 - 1) / g_1 + (g_2 - 1) / g_2``.
* each rank's shard is placed in the full matrix by the global indices its placements give it
  (:func:`shard_indices`), so uneven and empty shards and ``_StridedShard`` are exact.

The owner runs the same operations as ``torch.optim.Muon`` on the same full matrix: a 2-D
param gives the same bits as torch's Muon on the full tensor. Experts are orthogonalized in one
batched call per shape (``torch.baddbmm`` over the experts), which gives the bits of a loop over
experts through torch's own function on the CPU at the shapes the tests cover.

Note [Muon momentum state]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``state["momentum_buffer"]`` is created like the param (``torch.zeros_like(param)``): a DTensor
with the param's mesh and placements, so DCP saves it with the param's sharding and reshards it
on load, and the step updates its local shard in place. The state has the key and meaning of
``torch.optim.Muon``'s.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "Muon",
    "MuonParamGroups",
    "muon_param_groups",
    "newton_schulz",
    "shard_indices",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's)
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalize one matrix ``(m, n)`` or a batch of matrices ``(e, m, n)`` in ``dtype``.

    The operations of ``torch.optim.Muon``'s Newton-Schulz iteration: cast to ``dtype``
    (torch's: bfloat16),
    transpose when ``m > n``, divide by the Frobenius norm (at least ``eps``), then ``steps``
    quintic iterations with ``coefficients`` ``(a, b, c)``. A batch runs each matrix's
    iteration with ``torch.baddbmm`` and its own norm. The input is never modified. Local; no
    collective.
    """
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: Sequence[int]) -> float:
    """The lr of one matrix of shape ``(m, n)``, as ``torch.optim.Muon`` scales it.

    ``None``/``"original"``: ``lr * sqrt(max(1, m / n))`` (Keller Jordan's);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(m, n))`` (Moonshot's, to reuse AdamW's lr).
    """
    m, n = matrix_shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    return lr * 0.2 * math.sqrt(max(m, n))


# ----------------------------------------------------------------------------------------------
# Where each rank's shard sits in the global matrix
# ----------------------------------------------------------------------------------------------


def _chunks(idx: Tensor, n: int) -> list[Tensor]:
    """``torch.chunk`` into exactly ``n`` pieces, the missing ones empty (``Shard``'s split)."""
    pieces = list(idx.chunk(n)) if idx.numel() else []
    return pieces + [idx[:0]] * (n - len(pieces))


def _split(idx: Tensor, placement: Any, n: int) -> list[Tensor]:
    """The pieces ``placement`` deals to the ``n`` ranks of its mesh dim, as DTensor deals them.

    ``Shard``: ``torch.chunk``. ``_StridedShard(split_factor=f)``: ``f`` chunks, each chunked
    ``n`` ways, rank ``i`` taking piece ``i`` of each, in order.
    """
    if placement.is_shard():
        return _chunks(idx, n)
    first = _chunks(idx, int(placement.split_factor))
    second = [_chunks(piece, n) for piece in first]
    return [torch.cat([pieces[i] for pieces in second]) for i in range(n)]


def shard_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any],
    coordinate: Sequence[int],
) -> tuple[Tensor, ...]:
    """Per tensor dim, the global indices (in local order) of the shard at ``coordinate``.

    The local tensor of a DTensor of global ``shape`` with ``placements`` on a mesh of
    ``mesh_shape`` is ``full[idx_0][:, idx_1]...`` (``Shard`` and ``_StridedShard`` split;
    ``Replicate`` keeps). Local; no collective.
    """
    indices = [torch.arange(size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if _compat.splits_tensor(placement):
            dim = placement.dim % len(shape)
            pieces = _split(indices[dim], placement, mesh_shape[mesh_dim])
            indices[dim] = pieces[coordinate[mesh_dim]]
    return tuple(indices)


# ----------------------------------------------------------------------------------------------
# The plan of one step: which params are local, which are exchanged, and who owns what
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Matrix:
    """One matrix to orthogonalize: param ``slot`` (position in the step's list), expert
    ``expert`` of it (``None`` for a 2-D param), assembled on ``owner`` (coordinates on the
    exchange's gather dims)."""

    slot: int
    expert: int | None
    owner: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Exchange:
    """The params of one mesh that share the same gather dims (Note [Owner assembly]).

    ``dims``: the gather dims, in the order the matrices come together (inner first).
    ``blocks[slot][(coord, dims[:j])]``: per param, the global (row, column) indices of the
    block that the rank at mesh coordinate ``coord`` holds after gathering over ``dims[:j]``
    (every coordinate of this rank's gather group, ``j`` = 0 .. ``len(dims)``).
    """

    mesh: DeviceMesh
    dims: tuple[int, ...]
    dtype: torch.dtype  # what Newton-Schulz runs in, and what moves
    matrices: tuple[_Matrix, ...]
    split_dims: dict[tuple[int, int], int]  # (slot, mesh dim) -> matrix dim it splits (0 or 1)
    blocks: dict[int, dict[tuple[int, tuple[int, ...]], tuple[Tensor, Tensor]]]
    groups: dict[int, tuple[dist.ProcessGroup, list[int]]]  # gather dim -> _group_order
    in_order: frozenset[int]  # owned matrices whose assembled block is the matrix as it is


def _matrix_cost(shape: Sequence[int]) -> int:
    m, n = shape[-2:]
    return m * n * min(m, n)


def _deal_owners(
    costs: list[int], sizes: tuple[int, ...], offset: int
) -> list[tuple[int, ...]]:
    """Owners (coordinates over the gather dims of ``sizes``) for matrices of ``costs``:
    largest first to the least-loaded coordinate; ties go to the first from ``offset`` on."""
    count = math.prod(sizes)
    load = [0] * count
    owners: list[tuple[int, ...]] = [()] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        flat = min(range(count), key=lambda f: (load[f], (f - offset) % count))
        load[flat] += costs[i]
        owners[i] = tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), sizes))
    return owners


def _block_indices(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Any], coord: tuple[int, ...],
    dims: tuple[int, ...], split_dims: dict[int, int], cache: dict,
) -> tuple[Tensor, Tensor]:
    """(row, column) indices of the block the rank at ``coord`` holds after gathering ``dims``."""
    key = (coord, dims)
    if key not in cache:
        if not dims:
            idx = shard_indices(shape, mesh.shape, placements, coord)
            cache[key] = (idx[-2], idx[-1])
        else:
            last = dims[-1]
            parts = [
                _block_indices(
                    shape, mesh, placements, coord[:last] + (c,) + coord[last + 1:], dims[:-1],
                    split_dims, cache,
                )
                for c in range(mesh.size(last))
            ]
            k = split_dims[last]
            joined = torch.cat([p[k] for p in parts])
            cache[key] = (joined, parts[0][1]) if k == 0 else (parts[0][0], joined)
    return cache[key]


def _gather_dims(param: Tensor) -> tuple[int, ...]:
    """Mesh dims that split one of the param's matrix dims (its last two), inner first."""
    if not isinstance(param, DTensor):
        return ()
    ndim = param.ndim
    dims = [
        d for d, p in enumerate(param.placements)
        if _compat.splits_tensor(p) and p.dim % ndim >= ndim - 2
    ]
    return tuple(reversed(dims))


def _build_exchange(
    mesh: DeviceMesh, dims: tuple[int, ...], dtype: torch.dtype, slots: list[int],
    params: list[Tensor], offset: int,
) -> _Exchange:
    """Owners and block indices of one exchange (every rank computes the same)."""
    items, costs = [], []
    split_dims: dict[tuple[int, int], int] = {}
    blocks: dict[int, dict] = {}
    for slot in slots:
        p = params[slot]
        for d in dims:
            split_dims[(slot, d)] = p.placements[d].dim % p.ndim - (p.ndim - 2)
        experts = [None] if p.ndim == 2 else list(range(_compat.local_tensor(p).size(0)))
        items.extend((slot, e) for e in experts)
        costs.extend(_matrix_cost(p.shape) for _ in experts)
    owners = _deal_owners(costs, tuple(mesh.size(d) for d in dims), offset)
    my = tuple(mesh.get_coordinate())
    for slot in slots:
        p = params[slot]
        cache: dict = {}
        sd = {d: split_dims[(slot, d)] for d in dims}
        for j in range(len(dims) + 1):
            for coord in _coords_along(my, dims, mesh):
                _block_indices(p.shape, mesh, p.placements, coord, dims[:j], sd, cache)
        blocks[slot] = cache
    matrices = tuple(
        _Matrix(slot=s, expert=e, owner=o) for (s, e), o in zip(items, owners, strict=True)
    )
    in_order = frozenset(
        i for i, m in enumerate(matrices)
        if m.owner == tuple(my[d] for d in dims)
        and _in_order(*blocks[m.slot][(my, dims)], params[m.slot].shape[-2:])
    )
    return _Exchange(mesh=mesh, dims=dims, dtype=dtype, matrices=matrices,
                     split_dims=split_dims, blocks=blocks,
                     groups={d: _group_order(mesh, d) for d in dims}, in_order=in_order)


def _coords_along(my: tuple[int, ...], dims: tuple[int, ...], mesh: DeviceMesh):
    """Every mesh coordinate that differs from ``my`` only on ``dims``."""
    ranges = [range(mesh.size(d)) if d in dims else [c] for d, c in enumerate(my)]
    grid = torch.cartesian_prod(*[torch.tensor(list(r)) for r in ranges]).reshape(-1, len(my))
    return [tuple(int(c) for c in row) for row in grid]


# ----------------------------------------------------------------------------------------------
# Running one exchange: to the owners, Newton-Schulz, and back
# ----------------------------------------------------------------------------------------------


def _group_order(mesh: DeviceMesh, dim: int) -> tuple[dist.ProcessGroup, list[int]]:
    """The process group of ``mesh`` dim ``dim`` and, per group rank, its coordinate on ``dim``."""
    group = mesh.get_group(dim)
    coord = mesh.get_coordinate()
    along = mesh.mesh.movedim(dim, -1)[tuple(c for i, c in enumerate(coord) if i != dim)]
    position = {int(r): c for c, r in enumerate(along.tolist())}
    return group, [position[r] for r in dist.get_process_group_ranks(group)]


def _flat(blocks: list[Tensor], dtype: torch.dtype, device: str) -> Tensor:
    if not blocks:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1) for t in blocks])


def _all_to_all(
    send: list[list[Tensor]], recv_numels: list[int], dim: int, ex: _Exchange
) -> list[Tensor]:
    """One ``all_to_all_single`` over ``ex.mesh`` dim ``dim``: ``send[c]`` (blocks of
    ``ex.dtype``) goes to coordinate ``c``; returns the flat buffer received from each
    coordinate. What a rank sends itself stays out of the collective."""
    mesh = ex.mesh
    group, coords = ex.groups[dim]
    me = mesh.get_coordinate()[dim]
    size = ex.dtype.itemsize
    flat = {c: _flat(send[c], ex.dtype, mesh.device_type) for c in coords}
    inp = torch.cat([flat[c] for c in coords if c != me] or [flat[me]])
    out = torch.empty(sum(recv_numels) - recv_numels[me], dtype=ex.dtype, device=inp.device)
    in_splits = [0 if c == me else size * flat[c].numel() for c in coords]
    out_splits = [0 if c == me else size * recv_numels[c] for c in coords]
    # bytes as uint8: gloo's all-to-all takes neither bfloat16 nor int16
    dist.all_to_all_single(
        out.view(torch.uint8), inp[: sum(in_splits) // size].view(torch.uint8), out_splits,
        in_splits, group=group,
    )
    others = [c for c in coords if c != me]
    pieces = dict(zip(others, out.split([recv_numels[c] for c in others]), strict=True))
    pieces[me] = flat[me]
    return [pieces[c] for c in range(mesh.size(dim))]


def _block_shape(ex: _Exchange, i: int, coord: tuple[int, ...], j: int) -> tuple[int, int]:
    slot = ex.matrices[i].slot
    rows, cols = ex.blocks[slot][(coord, ex.dims[:j])]
    return rows.numel(), cols.numel()


def _at(coord: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return coord[:dim] + (value,) + coord[dim + 1:]


def _phase(ex: _Exchange, j: int, my: tuple[int, ...]) -> tuple[int, int, list[int]]:
    """Phase ``j``'s mesh dim, its size, and the matrices that move in it: those whose owner
    agrees with this rank on the dims of the phases before."""
    d = ex.dims[j]
    mine = tuple(my[x] for x in ex.dims[:j])
    return d, ex.mesh.size(d), [i for i, m in enumerate(ex.matrices) if m.owner[:j] == mine]


def _gather_phase(ex: _Exchange, held: dict[int, Tensor], j: int, my: tuple[int, ...]) -> None:
    """Phase ``j``: every block of an active matrix moves to its owner's coordinate on
    ``dims[j]``, where the blocks are joined along the matrix dim that ``dims[j]`` splits."""
    d, size, active = _phase(ex, j, my)
    send: list[list[Tensor]] = [[] for _ in range(size)]
    for i in active:
        send[ex.matrices[i].owner[j]].append(held.pop(i))
    kept = [i for i in active if ex.matrices[i].owner[j] == my[d]]
    shapes = [[_block_shape(ex, i, _at(my, d, c), j) for i in kept] for c in range(size)]
    got = _all_to_all(send, [sum(r * k for r, k in s) for s in shapes], d, ex)
    for pos, i in enumerate(kept):
        parts = []
        for c in range(size):
            start = sum(r * k for r, k in shapes[c][:pos])
            rows, cols = shapes[c][pos]
            parts.append(got[c][start:start + rows * cols].view(rows, cols))
        held[i] = torch.cat(parts, dim=ex.split_dims[(ex.matrices[i].slot, d)])


def _scatter_phase(ex: _Exchange, held: dict[int, Tensor], j: int, my: tuple[int, ...]) -> None:
    """The mirror of :func:`_gather_phase`: each joined block splits back to where its parts
    came from."""
    d, size, active = _phase(ex, j, my)
    send: list[list[Tensor]] = [[] for _ in range(size)]
    for i in active:
        if ex.matrices[i].owner[j] != my[d]:
            continue
        k = ex.split_dims[(ex.matrices[i].slot, d)]
        sizes = [_block_shape(ex, i, _at(my, d, c), j)[k] for c in range(size)]
        for c, part in enumerate(held.pop(i).split(sizes, dim=k)):
            send[c].append(part)
    shapes = [
        [_block_shape(ex, i, my, j) for i in active if ex.matrices[i].owner[j] == c]
        for c in range(size)
    ]
    got = _all_to_all(send, [sum(r * k for r, k in s) for s in shapes], d, ex)
    offsets = [0] * size
    for i in active:
        c = ex.matrices[i].owner[j]
        rows, cols = _block_shape(ex, i, my, j)
        held[i] = got[c][offsets[c]:offsets[c] + rows * cols].view(rows, cols)
        offsets[c] += rows * cols


def _in_order(rows: Tensor, cols: Tensor, shape: Sequence[int]) -> bool:
    """Whether a block with these row and column indices is the matrix of ``shape`` itself."""
    return (
        rows.numel() == shape[0] and cols.numel() == shape[1]
        and torch.equal(rows, torch.arange(shape[0])) and torch.equal(cols, torch.arange(shape[1]))
    )


def _place(block: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    """The full matrix from a block whose rows and columns are ``rows`` and ``cols`` of it."""
    full = block.new_empty(shape)
    full[rows.unsqueeze(1).to(block.device), cols.to(block.device)] = block
    return full


def _take(full: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The block of ``full`` at ``rows`` and ``cols`` (the inverse of :func:`_place`)."""
    return full[rows.unsqueeze(1).to(full.device), cols.to(full.device)]


def _orthogonalize_owned(
    ex: _Exchange, held: dict[int, Tensor], my: tuple[int, ...], entries: list[_Entry]
) -> None:
    """Newton-Schulz on the matrices this rank owns; experts of one shape and settings batched."""
    owned = [i for i, m in enumerate(ex.matrices) if m.owner == tuple(my[d] for d in ex.dims)]
    batches: dict[tuple, list[int]] = {}
    fulls: dict[int, Tensor] = {}
    for i in owned:
        entry = entries[ex.matrices[i].slot]
        rows, cols = ex.blocks[ex.matrices[i].slot][(my, ex.dims)]
        shape = tuple(entry.param.shape[-2:])
        fulls[i] = held[i] if i in ex.in_order else _place(held[i], rows, cols, shape)
        if ex.matrices[i].expert is None:
            fulls[i] = newton_schulz(fulls[i], *entry.ns)
        else:
            batches.setdefault((tuple(fulls[i].shape), entry.ns), []).append(i)
    for (_, ns), members in batches.items():
        ortho = newton_schulz(torch.stack([fulls[i] for i in members]), *ns)
        fulls.update(zip(members, ortho.unbind(0), strict=True))
    for i in owned:
        rows, cols = ex.blocks[ex.matrices[i].slot][(my, ex.dims)]
        held[i] = fulls[i] if i in ex.in_order else _take(fulls[i], rows, cols)


def _run_exchange(ex: _Exchange, entries: list[_Entry], updates: dict[int, Tensor]) -> None:
    """Orthogonalize the updates of ``ex``'s params in place of ``updates`` (``ex.dtype`` local
    shards). Collectives: ``2 * len(ex.dims)`` ``all_to_all_single`` (Note [Owner assembly])."""
    my = tuple(ex.mesh.get_coordinate())
    held = {
        i: updates[m.slot] if m.expert is None else updates[m.slot][m.expert]
        for i, m in enumerate(ex.matrices)
    }
    for j in range(len(ex.dims)):
        _gather_phase(ex, held, j, my)
    _orthogonalize_owned(ex, held, my, entries)
    for j in reversed(range(len(ex.dims))):
        _scatter_phase(ex, held, j, my)
    for slot in {m.slot for m in ex.matrices}:
        pieces = [held[i] for i, m in enumerate(ex.matrices) if m.slot == slot]
        updates[slot] = pieces[0] if entries[slot].param.ndim == 2 else torch.stack(pieces)


# ----------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Entry:
    """One param with a grad in this step, with its group's settings."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None
    ns: tuple  # (coefficients, steps, eps, dtype): newton_schulz's arguments after the update


def _describe(p: Tensor) -> str:
    if isinstance(p, DTensor):
        return f"shape {tuple(p.shape)}, placements {p.placements} on {p.device_mesh}"
    return f"shape {tuple(p.shape)}"


def _check_hyper(group: dict, where: str) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: a tensor lr must have one element, got shape {lr.shape}")
        lr = float(lr)
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{where}: lr must be a finite number >= 0, got {lr}")
    for name in ("momentum", "weight_decay"):
        value = group[name]
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value}")
    if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(
            f"{where}: adjust_lr_fn {group['adjust_lr_fn']!r} is not supported; use None, "
            "'original' or 'match_rms_adamw'"
        )
    steps = group["ns_steps"]
    if not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"{where}: ns_steps must be an int in [0, 100), got {steps!r}")
    dtype = group["ns_dtype"]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{where}: ns_dtype must be a floating-point torch.dtype (torch's Muon: "
            f"torch.bfloat16), got {dtype!r}"
        )
    if len(tuple(group["ns_coefficients"])) != 3:
        raise ValueError(
            f"{where}: ns_coefficients must be three numbers (a, b, c), got "
            f"{group['ns_coefficients']!r}"
        )


def _check_param(p: Tensor, where: str) -> None:
    """What :class:`Muon` can step; raised before any collective, from global facts only."""
    if not isinstance(p, Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(p).__name__}")
    if p.ndim not in (2, 3):
        raise ValueError(
            f"{where} has {_describe(p)}: Muon steps 2-D matrices (m, n) and 3-D routed expert "
            "weights (E, m, n) only; give norms, biases and other params to AdamW "
            "(dtensor_moe.optim.muon_param_groups splits a model's params)"
        )
    if torch.is_complex(p):
        raise ValueError(f"{where} is complex ({p.dtype}); Muon supports real params only")
    if not isinstance(p, DTensor):
        return
    if p.device_mesh.get_coordinate() is None:
        raise ValueError(
            f"{where} has {_describe(p)}, a mesh without rank {dist.get_rank()}: the owner "
            "assignment needs every rank of a param's mesh to step it, and only those; pass "
            "each rank the params whose mesh contains it"
        )
    partial = [pl for pl in p.placements if pl.is_partial()]
    if partial:
        raise ValueError(
            f"{where} has {_describe(p)}: a Partial param has no matrix to orthogonalize; "
            "redistribute it to Shard or Replicate placements"
        )
    _check_tiles(p, where, "its local shard")


def _check_tiles(t: DTensor, where: str, what: str) -> None:
    """The local shard of ``t`` has the shape its placements give this rank."""
    expected = tuple(
        idx.numel()
        for idx in shard_indices(
            t.shape, t.device_mesh.shape, t.placements, t.device_mesh.get_coordinate()
        )
    )
    local = tuple(_compat.local_tensor(t).shape)
    if local != expected:
        raise ValueError(
            f"{where} has {_describe(t)}, and {what} on rank {dist.get_rank()} has "
            f"shape {local}, but those placements give this rank {expected}: the shards do "
            "not tile the matrix. Build it with distribute_tensor, or DTensor.from_local "
            "with torch.chunk-sized shards"
        )


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` over plain and DTensor params on any number of meshes, 2-D matrices
    and 3-D routed expert weights ``(E, m, n)`` (one matrix per expert).

    Arguments, defaults and update are ``torch.optim.Muon``'s (Note [Muon update]); a 2-D param
    gets the same bits as torch's Muon stepping the full tensor.

    Keyword Args:
        lr: learning rate, a float or a one-element tensor (default ``1e-3``).
        weight_decay: decoupled weight decay, ``param *= 1 - lr * weight_decay`` (``0.1``).
        momentum: ``0.95``. nesterov: ``True``.
        ns_coefficients: ``(a, b, c)`` of the quintic Newton-Schulz iteration
            (:data:`DEFAULT_NS_COEFFICIENTS`). ns_steps: iterations (``5``). eps: lower bound of
            the norm Newton-Schulz divides by (``1e-7``).
        adjust_lr_fn: ``None``/``"original"`` (``lr * sqrt(max(1, m / n))``) or
            ``"match_rms_adamw"`` (``lr * 0.2 * sqrt(max(m, n))``, to reuse AdamW's lr and
            weight decay), per matrix ``(m, n)``: an expert's own shape for a 3-D param.

    Collectives, per ``step()``: none for plain and ``Replicate`` params and for experts split
    on their expert dim only. Params split along a matrix dim are assembled on one owner rank
    per matrix: ``2 * g`` ``all_to_all_single`` calls for each (mesh, gather dims) group of
    params, ``g`` being the number of mesh dims that split their matrices (Note [Owner
    assembly]); a grad in other placements than its param is first redistributed on that mesh.

    Every rank of a param's mesh must step it in the same step (SPMD: the same params, with
    grads, in the same order), as for FSDP2's own collectives.

    Raises:
        ValueError: at construction or at ``step()``, before any collective: a param that is
            not 2-D or 3-D, a ``Partial`` param, a param on a mesh without this rank, local
            shards that do not tile the matrix, a grad of another shape or mesh, a non-finite
            or negative lr, momentum or weight decay, an unknown ``adjust_lr_fn``.

    Example::

        groups = dtensor_moe.optim.muon_param_groups(model)
        muon = dtensor_moe.optim.Muon(groups.muon, lr=3e-3, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(groups.adamw, lr=3e-3, fused=True)
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        _check_hyper(defaults, "Muon")
        self._exchanges: dict[tuple, _Exchange] = {}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also for a ``state_dict`` of ``torch.optim.Muon``, whose groups have no ``ns_dtype``."""
        super().__setstate__(state)
        if not hasattr(self, "_exchanges"):  # unpickled: the plans are rebuilt at the next step
            self._exchanges = {}
        for group in self.param_groups:
            group.setdefault("ns_dtype", torch.bfloat16)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``, then the group's settings and params are checked."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        _check_hyper(group, f"Muon param group {index}")
        for i, p in enumerate(group["params"]):
            _check_param(p, f"Muon param group {index}, param {i}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step over every param with a grad. See the class docstring for the
        collectives; every check runs before the first of them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = [_align_grad(entry) for entry in self._entries()]
        updates = {slot: _momentum_update(e) for slot, e in enumerate(entries)}
        for ex in self._plan(entries):
            _run_exchange(ex, entries, updates)
        for slot, entry in enumerate(entries):
            _apply(entry, updates[slot])
        return loss

    def _entries(self) -> list[_Entry]:
        """Every param with a grad, checked (nothing communicates here)."""
        entries = []
        for g, group in enumerate(self.param_groups):
            _check_hyper(group, f"Muon param group {g}")
            lr = float(group["lr"]) if isinstance(group["lr"], Tensor) else group["lr"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"Muon param group {g}, param {i}"
                _check_param(p, where)
                _check_grad(p, p.grad, where)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                entries.append(_Entry(
                    param=p, grad=p.grad, buf=state["momentum_buffer"], lr=lr,
                    weight_decay=group["weight_decay"], momentum=group["momentum"],
                    nesterov=group["nesterov"], adjust_lr_fn=group["adjust_lr_fn"],
                    ns=(tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"],
                        group["ns_dtype"]),
                ))
        return entries

    def _plan(self, entries: list[_Entry]) -> list[_Exchange]:
        """The exchanges of this step, in the order of their first param; reused while the
        params' meshes, placements and shapes stay the same."""
        by_key: dict[tuple, list[int]] = {}
        for slot, entry in enumerate(entries):
            dims = _gather_dims(entry.param)
            if dims:
                key = (entry.param.device_mesh, dims, entry.ns[3])
                by_key.setdefault(key, []).append(slot)
        plans, cache, offset = [], {}, 0
        params = [e.param for e in entries]
        for (mesh, dims, dtype), slots in by_key.items():
            key = (mesh, dims, dtype, offset, tuple(
                (s, tuple(params[s].shape), tuple(params[s].placements)) for s in slots
            ))
            ex = self._exchanges.get(key)
            if ex is None:
                ex = _build_exchange(mesh, dims, dtype, slots, params, offset)
            cache[key] = ex
            plans.append(ex)
            offset += len(ex.matrices)
        self._exchanges = cache
        return plans


def _check_grad(p: Tensor, grad: Tensor, where: str) -> None:
    if grad.is_sparse:
        raise ValueError(f"{where}: Muon does not support sparse gradients")
    if isinstance(p, DTensor) != isinstance(grad, DTensor) or (
        isinstance(p, DTensor) and grad.device_mesh != p.device_mesh
    ):
        raise ValueError(
            f"{where} has {_describe(p)} but its grad has {_describe(grad)}: a grad must live "
            "on its param's mesh"
        )
    if isinstance(grad, DTensor):
        _check_tiles(grad, where, "its grad's local shard")


def _align_grad(entry: _Entry) -> _Entry:
    """A DTensor grad in other placements than its param: redistributed on the param's mesh."""
    p, grad = entry.param, entry.grad
    if isinstance(p, DTensor) and tuple(grad.placements) != tuple(p.placements):
        return dataclasses.replace(entry, grad=grad.redistribute(p.device_mesh, p.placements))
    return entry


def _local(t: Tensor) -> Tensor:
    return _compat.local_tensor(t) if isinstance(t, DTensor) else t


def _momentum_update(entry: _Entry) -> Tensor:
    """Momentum on the local shards, and the update cast to ``ns_dtype`` (elementwise,
    so the same bits as on the full tensor); local params are orthogonalized here already."""
    grad, buf = _local(entry.grad), _local(entry.buf)
    buf.lerp_(grad, 1 - entry.momentum)
    update = grad.lerp(buf, entry.momentum) if entry.nesterov else buf
    if _gather_dims(entry.param):
        return update.to(entry.ns[3], copy=True)
    return newton_schulz(update, *entry.ns)


def _apply(entry: _Entry, ortho: Tensor) -> None:
    """Decoupled weight decay, then the orthogonalized update at the matrix's adjusted lr."""
    p = _local(entry.param)
    p.mul_(1 - entry.lr * entry.weight_decay)
    p.add_(ortho, alpha=-adjusted_lr(entry.lr, entry.adjust_lr_fn, entry.param.shape[-2:]))


# ----------------------------------------------------------------------------------------------
# The usual recipe: Muon for hidden matrices and routed experts, AdamW for the rest
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonParamGroups:
    """A model's trainable params split for two optimizers, in ``named_parameters`` order.

    ``muon``: hidden 2-D matrices and 3-D routed expert weights, for :class:`Muon`.
    ``adamw``: everything else (embeddings, the output head, norms, the router gate, biases,
    a learned expert bias), for ``torch.optim.AdamW``. ``*_names``: their qualified names.
    """

    muon: tuple[nn.Parameter, ...]
    adamw: tuple[nn.Parameter, ...]
    muon_names: tuple[str, ...]
    adamw_names: tuple[str, ...]


def _is_router_gate(module: nn.Module) -> bool:
    from dtensor_moe.moe.router import RouterGate

    return isinstance(module, RouterGate)


def _default_choice(module: nn.Module, module_name: str, param: Tensor, output_names) -> str:
    """``"adamw"`` or ``"muon"`` for a param of ``module`` without an override."""
    last = module_name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding) or _is_router_gate(module) or last in output_names:
        return "adamw"
    return "muon" if param.ndim in (2, 3) else "adamw"


def muon_param_groups(
    model: nn.Module,
    *,
    adamw: Iterable[str] = (),
    muon: Iterable[str] = (),
    output_names: Iterable[str] = ("output", "head", "lm_head"),
) -> MuonParamGroups:
    """Split ``model``'s trainable params into :class:`Muon` and AdamW params.

    Defaults: params of ``nn.Embedding`` modules, of the MoE router's gate
    (:class:`~dtensor_moe.moe.router.RouterGate`) and of modules whose last name is in
    ``output_names`` (the LM head) go to AdamW; other 2-D and 3-D params (attention and MLP
    matrices, routed and shared experts) to Muon; 1-D and 0-D params (norms, biases, a learned
    expert bias) to AdamW. Works on the model before or after the parallel styles and FSDP2
    (module types and param names stay). A param shared by several modules is listed once.

    Keyword Args:
        adamw: ``fnmatch`` patterns of param names forced to AdamW (checked first).
        muon: patterns of param names forced to Muon; they must be 2-D or 3-D.
        output_names: last module names taken for the output head.

    Raises:
        ValueError: a ``muon`` override matching a param that is not 2-D or 3-D.

    Example::

        groups = muon_param_groups(model, adamw=["layers.*.attention.wo.weight"])
        muon = Muon(groups.muon, lr=3e-3, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(groups.adamw, lr=3e-3, fused=True)
    """
    adamw, muon, output_names = tuple(adamw), tuple(muon), tuple(output_names)
    chosen: dict[str, list] = {"muon": [], "adamw": []}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{pname}" if module_name else pname
            if any(fnmatch.fnmatchcase(name, pat) for pat in adamw):
                choice = "adamw"
            elif any(fnmatch.fnmatchcase(name, pat) for pat in muon):
                if param.ndim not in (2, 3):
                    raise ValueError(
                        f"muon_param_groups: {name} (shape {tuple(param.shape)}) matches a "
                        f"muon pattern of {muon}, but Muon steps 2-D and 3-D params only"
                    )
                choice = "muon"
            else:
                choice = _default_choice(module, module_name, param, output_names)
            chosen[choice].append((name, param))
    return MuonParamGroups(
        muon=tuple(p for _, p in chosen["muon"]),
        adamw=tuple(p for _, p in chosen["adamw"]),
        muon_names=tuple(n for n, _ in chosen["muon"]),
        adamw_names=tuple(n for n, _ in chosen["adamw"]),
    )
