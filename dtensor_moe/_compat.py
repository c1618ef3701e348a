"""The one module that touches private torch internals.

Every other module of dtensor_moe uses public API only. When a torch release moves one of the
pieces below, this is the file to update. Each helper names the torch 2.13 internal it relies on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "PLAIN_TENSOR_TYPES",
    "bounded_put",
    "DTensorSpec",
    "clear_sharding_prop_cache",
    "contiguous_stride",
    "custom_op_handlers",
    "device_has_foreach_support",
    "dtensor_from_local_spec",
    "dtensor_specs",
    "flatten_mesh",
    "in_backward_pass",
    "local_tensor",
    "local_tensors",
    "original_torch_function",
    "patch_optimizer_grouping",
    "patch_torch_function",
    "locals_if_aligned",
    "replace_dtensor_storage",
    "schema_of",
    "spec_of",
    "spec_dtype",
    "splits_tensor",
    "subclass_torch_function_disabled",
]

OpHandler = Callable[[torch._ops.OpOverload, tuple, dict], Any]


def custom_op_handlers() -> dict[torch._ops.OpOverload, OpHandler]:
    """The live ``op -> handler`` table that DTensor consults before sharding propagation.

    ``DTensor._op_dispatcher._custom_op_handlers`` (torch 2.13). The C++ dispatch fast path
    checks this table too, so a handler here skips sharding propagation entirely.
    """
    return DTensor._op_dispatcher._custom_op_handlers


def schema_of(op: torch._ops.OpOverload) -> torch._C.FunctionSchema:
    """``OpOverload._schema``: argument names, types and positions of an aten overload."""
    return op._schema


def clear_sharding_prop_cache() -> None:
    """Drop the Python and C++ sharding-propagation caches after changing a rule or handler.

    The same two calls as ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` (torch
    2.13), made directly: importing ``torch.distributed.tensor.debug`` imports numpy (through its
    sharding visualizer), which is not a dependency of torch or of dtensor_moe.
    """
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def spec_of(t: DTensor) -> DTensorSpec:
    """``DTensor._spec``: the mesh, placements and global metadata, without a copy."""
    return t._spec


def local_tensor(t: DTensor) -> torch.Tensor:
    """``DTensor._local_tensor``: the local shard, without the autograd-aware ``to_local``."""
    return t._local_tensor


def dtensor_from_local_spec(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """Wrap ``local`` as a DTensor with exactly ``spec`` (no checks, no communication).

    The caller guarantees that ``local`` is this rank's shard of a tensor described by ``spec``.
    """
    return DTensor(local, spec, requires_grad=False)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as torch does)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _LocalViews(torch.autograd.Function):
    """Local tensors of several DTensors in one node; backward wraps each gradient with a spec.

    The forward returns ``t._local_tensor.view_as(...)`` like ``DTensor.to_local``; the backward
    wraps each (contiguous) local gradient with its precomputed gradient spec, which is what
    ``to_local(grad_placements=...)``'s backward builds, minus the per-call spec construction.
    """

    @staticmethod
    def forward(ctx: Any, grad_specs: tuple[DTensorSpec, ...], *ts: DTensor) -> tuple:
        ctx.grad_specs = grad_specs
        return tuple(t._local_tensor.view_as(t._local_tensor) for t in ts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return (
            None,
            *(
                None if g is None else DTensor(g.contiguous(), spec, requires_grad=False)
                for g, spec in zip(grads, ctx.grad_specs)
            ),
        )


# (spec identity, gradient placements) -> (spec, gradient spec); bounded like _ALIGNED.
_GRAD_SPECS: dict[tuple[int, tuple], tuple[DTensorSpec, DTensorSpec]] = {}


def _grad_spec(t: DTensor, grad_placements: tuple) -> DTensorSpec | None:
    spec = t._spec
    key = (id(spec), grad_placements)
    hit = _GRAD_SPECS.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    meta = spec.tensor_meta
    if not t._local_tensor.is_contiguous() or meta is None:
        return None
    # A contiguous local gradient has the global stride of a contiguous tensor (what torch's
    # to_local backward computes from it); the parameter's own stride is that when it is
    # contiguous, which ``distribute_tensor`` produces.
    if tuple(meta.stride) != contiguous_stride(meta.shape):
        return None
    grad_spec = DTensorSpec(spec.mesh, grad_placements, tensor_meta=meta)
    bounded_put(_GRAD_SPECS, key, (spec, grad_spec), _ALIGNED_MAX)
    return grad_spec


def local_views(ts: tuple[DTensor, ...], grad_placements: tuple[tuple, ...]) -> tuple:
    """``tuple(t.to_local(grad_placements=g) for t, g in zip(ts, grad_placements))``, cheaper.

    One autograd node for all of them and cached gradient specs; falls back to ``to_local``
    when a local tensor or the global layout is not contiguous.
    """
    specs = tuple(_grad_spec(t, g) for t, g in zip(ts, grad_placements))
    if any(s is None for s in specs):
        return tuple(t.to_local(grad_placements=list(g)) for t, g in zip(ts, grad_placements))
    return _LocalViews.apply(specs, *ts)


def replace_dtensor_storage(dst: DTensor, src: DTensor) -> None:
    """Make ``dst`` hold ``src``'s local tensor and spec (same global shape, new placements).

    Used to write a mutated optimizer argument back when its original placement (for example
    ``Partial``) cannot be reached again by ``redistribute``.
    """
    if dst.shape != src.shape:
        raise AssertionError(f"global shapes differ: {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst._local_tensor = src._local_tensor
    dst._spec = src._spec


# Note [Aligned-slot cache]
# A fused optimizer step sees the same param/state DTensors step after step. Whether list
# ``values`` is slot-by-slot aligned with ``params`` depends only on their DTensorSpecs (mesh,
# placements and global shape/stride/dtype), which are immutable: a DTensor whose layout changes
# gets a new spec object. So each (argument position, first param spec, length) remembers the
# last spec tuples it found aligned; the next step compares the current specs with those by one
# tuple ``==``: a C-level pass that succeeds on identity without calling ``DTensorSpec.__eq__``
# (it calls it for a new but equal spec; equal specs describe the same layout, and a tuple of
# new objects replaces the cached one so that later steps match on identity again). On a match
# the per-slot checks are skipped. Lists of plain 0-dim tensors (``state_steps``) are remembered by
# the identity of the tensors themselves. Local tensors are read afresh at every step, since
# FSDP2 and others may swap a DTensor's local tensor in place. The passes are list
# comprehensions over the ``_spec`` / ``_local_tensor`` slots, which CPython specializes: about
# twice as fast as ``map(operator.attrgetter(...))``.
_ALIGNED: dict[tuple, tuple] = {}
_ALIGNED_MAX = 256


def dtensor_specs(values: list, canonical_key=None) -> tuple[DTensorSpec, ...] | None:
    """The specs of ``values`` if every entry is a DTensor, else ``None``.

    With ``canonical_key``, a tuple equal (entry by entry) to the one returned last time for
    that key is returned as the *same* tuple object, so later checks can compare it with ``is``.
    """
    try:
        specs = tuple([v._spec for v in values])
    except AttributeError:
        return None
    if canonical_key is None:
        return specs
    key = ("canonical", canonical_key, len(specs))
    cached = _ALIGNED.get(key)
    if cached is not None and _same_specs(cached[0], specs):
        return cached[0]
    _remember(key, (specs,))
    return specs


def _same_specs(cached: tuple, specs: tuple) -> bool:
    """``cached == specs``, and mostly the same objects (see Note [Aligned-slot cache]).

    A tuple of equal but new spec objects (other tensors with the same layouts) is reported as
    different, so the caller caches the new objects and later steps match on identity instead
    of calling ``DTensorSpec.__eq__`` for every slot.
    """
    return cached == specs and (not specs or (cached[0] is specs[0] and cached[-1] is specs[-1]))


def local_tensors(values: list) -> list[torch.Tensor]:
    """The local tensors of a list of DTensors, in one specialized pass."""
    return [v._local_tensor for v in values]


def spec_dtype(spec: DTensorSpec) -> torch.dtype | None:
    """The dtype a spec records, or ``None`` when it has no tensor metadata."""
    meta = spec.tensor_meta
    return None if meta is None else meta.dtype


def _specs_aligned(p_specs: tuple, v_specs: tuple) -> bool:
    """Same mesh, placements and dtype, slot by slot (run on cache misses only)."""
    for p, v in zip(p_specs, v_specs):
        if v is p:
            continue
        if (
            (v.mesh is not p.mesh and v.mesh != p.mesh)
            or v.placements != p.placements
            or spec_dtype(v) != spec_dtype(p)
        ):
            return False
    return True


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _remember(key: tuple, entry: tuple) -> None:
    bounded_put(_ALIGNED, key, entry, _ALIGNED_MAX)


def bounded_put(cache: dict, key: Hashable, value: object, limit: int) -> None:
    """``cache[key] = value``, emptying ``cache`` first when it already holds ``limit`` entries.

    The caches of this package are keyed by object identity and hold a handful of entries in
    steady state; emptying a full one bounds it (and drops entries for dead objects) without the
    bookkeeping of a least-recently-used cache.
    """
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


# Tensor types that are neither DTensor nor another subclass with its own behaviour.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_STEP_DTYPES = frozenset({torch.float32, torch.float64})


def _plain_scalars_ok(key: tuple, values: list) -> bool:
    """Whether ``values`` are all plain 0-dim float32/float64 tensors, as ``torch.optim``'s
    ``state_steps`` are (cached on the tensors' identities)."""
    cached = _ALIGNED.get(key)
    vals = tuple(values)
    if cached is not None and _same_objects(cached[0], vals):
        return True
    if (
        not set(map(type, vals)) <= PLAIN_TENSOR_TYPES
        or any(map(torch.Tensor.dim, vals))
        or not {t.dtype for t in vals} <= _STEP_DTYPES
    ):
        return False
    _remember(key, (vals,))
    return True


def locals_if_aligned(
    p_specs: tuple[DTensorSpec, ...] | None, values: list, specs_out: list | None, slot_key=None
) -> list[torch.Tensor] | None:
    """Local tensors of ``values`` if no slot needs redistribution or a careful check.

    A list passes when every entry is a DTensor with its param's mesh, placements and dtype
    (``p_specs`` are the params' specs from ``dtensor_specs(params, canonical_key=...)``,
    ``None`` when some param is a plain tensor), or when every entry is a plain 0-dim float
    tensor (torch.optim's ``state_steps``). Returns ``None`` (leaving ``specs_out``
    untouched) when any slot needs the careful per-slot treatment. ``slot_key`` names the
    argument (e.g. its schema position); see Note [Aligned-slot cache].
    """
    first = id(p_specs[0]) if p_specs else None
    key = (slot_key, first, len(values))
    v_specs = dtensor_specs(values)
    if v_specs is None:
        if not _plain_scalars_ok(key, values):
            return None
        if specs_out is not None:
            specs_out.extend([None] * len(values))
        return list(values)
    if p_specs is None:
        return None
    cached = _ALIGNED.get(key)
    if cached is None or not (cached[0] is p_specs and _same_specs(cached[1], v_specs)):
        if not _specs_aligned(p_specs, v_specs):
            return None
        _remember(key, (p_specs, v_specs))
    if specs_out is not None:
        specs_out.extend(v_specs)
    return [v._local_tensor for v in values]


def device_has_foreach_support(device: torch.device) -> bool:
    """``torch.utils._foreach_utils._device_has_foreach_support``: can foreach kernels run here?"""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return _device_has_foreach_support(device)


_ORIGINAL_TORCH_FUNCTIONS: dict[str, Callable] = {}


def original_torch_function(name: str) -> Callable:
    """The ``torch.<name>`` that torch shipped, even after :func:`patch_torch_function`."""
    return _ORIGINAL_TORCH_FUNCTIONS.get(name, getattr(torch, name))


def patch_torch_function(name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``torch.<name>`` by ``make_wrapper(original)``, at most once (idempotent).

    Used for the four in-place fused optimizer entry points that ``torch.optim`` looks up as
    ``torch._fused_adam_`` and friends at every step, so that DTensor args reach our handler
    without the generic ``__torch_dispatch__`` round trip; see Note [Fused fast entry].
    """
    if name not in _ORIGINAL_TORCH_FUNCTIONS:
        _ORIGINAL_TORCH_FUNCTIONS[name] = getattr(torch, name)
    setattr(torch, name, make_wrapper(_ORIGINAL_TORCH_FUNCTIONS[name]))


_ORIGINAL_GROUPING: list[Callable] = []


def patch_optimizer_grouping(make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``torch.optim.Optimizer._group_tensors_by_device_and_dtype`` (a private
    staticmethod that every foreach/fused ``torch.optim`` functional calls once per step to
    bucket its tensor lists by device and dtype) by ``make_wrapper(original)``, idempotently.

    See Note [Local grouping] in ``dtensor_moe/optim/fast_step.py``.
    """
    if not _ORIGINAL_GROUPING:
        _ORIGINAL_GROUPING.append(torch.optim.Optimizer._group_tensors_by_device_and_dtype)
    torch.optim.Optimizer._group_tensors_by_device_and_dtype = staticmethod(
        make_wrapper(_ORIGINAL_GROUPING[0])
    )


def in_backward_pass() -> bool:
    """Whether autograd is running a backward pass right now (``torch._C._current_graph_task_id``).

    It is ``-1`` outside a backward pass; torch's checkpoint code relies on the same call.
    """
    return torch._C._current_graph_task_id() != -1


def splits_tensor(placement) -> bool:
    """Whether ``placement`` splits the tensor across its mesh dim: ``Shard`` or ``_StridedShard``.

    torch 2.13's ``_StridedShard`` (what FSDP2 uses on top of a tp-sharded dim 0) is neither a
    ``Shard`` subclass nor ``is_shard()``, yet it partitions the elements like a shard.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def flatten_mesh(mesh):
    """A 1-D mesh over all ranks of ``mesh``, in row-major order (``DeviceMesh._flatten``).

    Used for the all-to-all of expert tensor parallelism over a 2-D ``(ep, etp)`` mesh. Torch
    creates the process groups of every such sub-mesh on every rank and caches the result, so
    calling it on each rank, in the same order, is safe and cheap after the first call.
    """
    return mesh if mesh.ndim == 1 else mesh._flatten()


def subclass_torch_function_disabled():
    """``torch._C.DisableTorchFunctionSubclass()``: a context where subclass ``__torch_function__``
    overrides are skipped (torch function *modes* still run).

    Every attribute read and every torch call on a tensor subclass first looks up the instance's
    ``__torch_function__``; DTensor's (and ``nn.Parameter``'s) is torch's disabled
    implementation, so inside this context they behave the same, only without that lookup.
    """
    return torch._C.DisableTorchFunctionSubclass()
