"""The one module that touches private torch internals, bar the allowlist below.

When a torch release moves one of the internals, this module (helpers and allowlist) is what to
update. Each helper names the torch 2.13 internal it relies on.

Note [Private torch names outside _compat]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every other module of dtensor_moe uses public torch API, except for the names listed here, each
only in the module named on its line. A listed name also covers the names under it (a private
module covers its functions). These are ops and functions that the code calls directly, with no
public equivalent in torch 2.13; a helper here would only rename them.

    dtensor_moe/moe/experts.py: torch._grouped_mm -- the grouped expert matmul
    dtensor_moe/parallel/dispatch.py: torch.distributed._functional_collectives -- the
        count/token all-to-alls of the plain EP path (all_to_all_single[_autograd], wait_tensor)
        and the static exchange at capacity, which traces under torch.compile
    dtensor_moe/moe/losses.py: torch.distributed._functional_collectives -- the all-reduce of
        the global-batch router statistics (traceable under torch.compile)
    dtensor_moe/parallel/token_parallel.py: torch.distributed._functional_collectives -- the
        all-gather of the routing table for expert capacity over a tp group (traceable)
    dtensor_moe/moe/dispatch.py: torch.ops.aten._embedding_bag_per_sample_weights_backward --
        the combine's score gradient: every (token, k) dot product in one pass, no temporaries
        (the per-sample-weight gradient of embedding_bag, whose forward is the combine)
    dtensor_moe/optim/clip.py: torch._foreach_norm -- as torch.nn.utils.clip_grad_norm_ uses it
    dtensor_moe/optim/clip.py: torch._foreach_mul_ -- as torch.nn.utils.clip_grad_norm_ uses it
    dtensor_moe/optim/fused.py: torch._ops.OpOverload -- the type of the aten overloads
    dtensor_moe/optim/scaler.py: torch.ops.aten._amp_foreach_non_finite_check_and_unscale_ --
        the GradScaler op whose DTensor handler scaler.py installs

``tests/test_private_api.py`` parses the lines of the form ``<module>: <torch name>`` above and
scans every module of the package with ``ast`` for torch names with a private segment
(``torch._x``, ``from torch._x import y``, ``import torch.distributed._x``, ``DTensor._x`` after
``from torch.distributed.tensor import DTensor``, ``getattr(torch, "_x")``, aliases such as
``aten = torch.ops.aten``). A name that is not listed for its module fails the test, and so does
a listed name that its module no longer uses. Names built at run time are out of an ``ast``
scan's reach; these are all of them (kept in this form so that the test's parser skips them):

    - dtensor_moe/optim/fused.py, by name: the 24 overloads of ``torch.ops.aten._fused_adam_``,
      ``_fused_adam``, ``_fused_adamw_``, ``_fused_adamw``, ``_fused_sgd_``, ``_fused_sgd``,
      ``_fused_adagrad_`` and ``_fused_adagrad`` (``getattr(aten, name)`` over ``FUSED_OPS``'s
      names): the ops whose DTensor handler it installs.
    - dtensor_moe/optim/fused.py, by name, through :func:`patch_torch_function`:
      ``torch._fused_adam_``, ``torch._fused_adamw_``, ``torch._fused_sgd_``,
      ``torch._fused_adagrad_``: the entry points the fast entry wraps.
"""

from __future__ import annotations

import weakref
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
    "GuardedCache",
    "SpecList",
    "clear_aligned_caches",
    "optimizer_step_body_cell",
    "patch_optimizer_grouping",
    "patch_torch_function",
    "unpatch_optimizer_grouping",
    "unpatch_torch_function",
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
        # Under create_graph=True (Note [Double backward] in dtensor_moe/moe/dispatch.py) the
        # direct wrap would cut the graph, so it wraps differentiably, as to_local's backward.
        wrap = _wrap_with_graph if torch.is_grad_enabled() else dtensor_from_local_spec
        return (
            None,
            *(
                None if g is None else wrap(g.contiguous(), spec)
                for g, spec in zip(grads, ctx.grad_specs)
            ),
        )


def _wrap_with_graph(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


# Note [Gradient-spec cache]
# ``local_views`` wraps each local gradient with a spec made of the DTensor's mesh and tensor
# metadata and the gradient placements. A parameter keeps its spec object step after step, so
# that gradient spec is built once per (spec, gradient placements) and remembered:
#   key:      ``id(spec)`` -> (weak reference to the spec, {gradient placements: gradient spec})
#   bound:    one entry per live spec that went through ``local_views``; a few placements each
#   lifetime: the spec's: the weak reference's callback drops the entry when the spec dies.
# A gradient spec holds the mesh and the tensor metadata, never the spec or a tensor, so the
# cache keeps nothing alive that the DTensor would not. ``_GRAD_SPECS.clear()`` is safe at any
# time (``dtensor_moe.clear_caches``).
_GRAD_SPECS: dict[int, tuple[weakref.ref, dict[tuple, DTensorSpec]]] = {}


def _grad_spec(t: DTensor, grad_placements: tuple) -> DTensorSpec | None:
    spec = t._spec
    entry = _GRAD_SPECS.get(id(spec))
    if entry is not None and entry[0]() is spec:
        hit = entry[1].get(grad_placements)
        if hit is not None:
            return hit
    meta = spec.tensor_meta
    if not t._local_tensor.is_contiguous() or meta is None:
        return None
    # A contiguous local gradient has the global stride of a contiguous tensor (what torch's
    # to_local backward computes from it); the parameter's own stride is that when it is
    # contiguous, which ``distribute_tensor`` produces.
    if tuple(meta.stride) != contiguous_stride(meta.shape):
        return None
    grad_spec = DTensorSpec(spec.mesh, grad_placements, tensor_meta=meta)
    if entry is None or entry[0]() is not spec:
        entry = (weakref.ref(spec, _grad_spec_dropper(id(spec))), {})
        _GRAD_SPECS[id(spec)] = entry
    entry[1][grad_placements] = grad_spec
    return grad_spec


def _grad_spec_dropper(key: int) -> Callable[[weakref.ref], None]:
    """The callback that removes ``_GRAD_SPECS[key]`` when its spec dies (and no newer entry)."""

    def drop(dead: weakref.ref) -> None:
        entry = _GRAD_SPECS.get(key)
        if entry is not None and entry[0] is dead:
            del _GRAD_SPECS[key]

    return drop


def local_views(ts: tuple[DTensor, ...], grad_placements: tuple[tuple, ...]) -> tuple:
    """``tuple(t.to_local(grad_placements=g) for t, g in zip(ts, grad_placements))``, cheaper.

    One autograd node for all of them and cached gradient specs; falls back to ``to_local``
    when a local tensor or the global layout is not contiguous, and while ``torch.compile``
    traces.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot pass DTensorSpecs into a custom autograd.Function; ``to_local`` traces
        # and gives the same views and gradients.
        return tuple(t.to_local(grad_placements=list(g)) for t, g in zip(ts, grad_placements))
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
# gets a new spec object. So each (argument, params) pair remembers the last spec list it found
# aligned; the next step compares the current specs with it by one tuple ``==``: a C-level pass
# that succeeds on identity without calling ``DTensorSpec.__eq__`` (it calls it for a new but
# equal spec; equal specs describe the same layout, and a tuple of new objects replaces the
# cached one so that later steps match on identity again). On a match the per-slot checks are
# skipped. Lists of plain 0-dim tensors (``state_steps``) are remembered by the identity of the
# tensors themselves. Local tensors are read afresh at every step, since FSDP2 and others may
# swap a DTensor's local tensor in place. The passes are list comprehensions over the ``_spec`` /
# ``_local_tensor`` slots, which CPython specializes: about twice as fast as
# ``map(operator.attrgetter(...))``.
#
# Note [Caches hold no tensors]
# Every entry of :data:`_ALIGNED` is a :class:`GuardedCache` entry: it holds weak references
# (with a callback) to the tensors it was computed from and is dropped the moment any of them
# dies. It never holds a tensor. It may hold DTensorSpecs (which hold a mesh, which holds its
# process groups), but only specs of DTensors that are still alive, or the spec a live DTensor
# had before it was re-laid out, until the next step over that list replaces the entry.
#
# _ALIGNED, two kinds of entry, both bounded at 256 entries together (emptied when full):
#   key (op or "local-grouping", len, id(first spec)) -> the params' canonical SpecList;
#     dropped when any param dies.
#   key ((op, arg) or ("local-grouping", i), id(canonical SpecList), len) -> a weak reference to
#     that SpecList and the specs found aligned with it, or the ids of plain 0-dim tensors
#     (``state_steps``); dropped when any tensor of that list dies.
#   ``clear_aligned_caches()`` empties it.
#
# ``_ORIGINAL_TORCH_FUNCTIONS`` and ``_ORIGINAL_GROUPING`` (below) hold torch's own functions:
# immortal objects, at most five entries, kept for the life of the process so that
# ``set_fast_paths(False)`` can put them back.


class _Entry:
    """One :class:`GuardedCache` entry: what the lookup compares, and the cached value."""

    __slots__ = ("check", "value", "_guards", "__weakref__")

    def __init__(self, check: object, value: object) -> None:
        self.check = check
        self.value = value
        self._guards: list = []


class GuardedCache:
    """``key -> entry`` where each entry is dropped as soon as one of the objects it was
    computed from is garbage-collected (Note [Caches hold no tensors]).

    At most ``limit`` entries: a full cache is emptied before the next entry goes in (see
    :func:`bounded_put`). The cache holds weak references only to the guarded objects.
    """

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int) -> None:
        self._entries: dict[Hashable, _Entry] = {}
        self._limit = limit

    def get(self, key: Hashable) -> _Entry | None:
        return self._entries.get(key)

    def put(self, key: Hashable, check: object, value: object, guarded: Sequence) -> _Entry:
        entry = _Entry(check, value)
        entry_ref = weakref.ref(entry)
        entries = self._entries

        def drop(_dead: weakref.ref) -> None:
            live = entry_ref()
            if live is not None and entries.get(key) is live:
                del entries[key]

        entry._guards = [weakref.ref(obj, drop) for obj in guarded]
        bounded_put(entries, key, entry, self._limit)
        return entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class SpecList(list):
    """The DTensorSpecs of a tensor list, in a container that can be referenced weakly (tuples
    cannot). Never mutated once built."""


_ALIGNED_MAX = 256
_ALIGNED = GuardedCache(_ALIGNED_MAX)


def clear_aligned_caches() -> None:
    """Empty the aligned-slot cache (Note [Aligned-slot cache]); the next step rebuilds it."""
    _ALIGNED.clear()


def dtensor_specs(values: list, canonical_key=None) -> SpecList | None:
    """The specs of ``values`` if every entry is a DTensor, else ``None``.

    With ``canonical_key``, a tuple equal (entry by entry) to the one returned last time for
    that key and these tensors is returned as the *same* :class:`SpecList` object, so later
    checks can compare it with ``is``.
    """
    try:
        specs = SpecList([v._spec for v in values])
    except AttributeError:
        return None
    if canonical_key is None or not specs:
        return specs
    key = (canonical_key, len(specs), id(specs[0]))
    cached = _ALIGNED.get(key)
    if cached is not None and _same_specs(cached.check, specs):
        return cached.check
    _ALIGNED.put(key, specs, None, values)
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


def _spec_shape(spec: DTensorSpec) -> torch.Size | None:
    meta = spec.tensor_meta
    return None if meta is None else meta.shape


def _specs_aligned(p_specs: tuple, v_specs: tuple) -> bool:
    """Same mesh, placements, global shape and dtype, slot by slot (run on cache misses only).

    A slot that differs in anything (a state of another global shape included) leaves the list
    to the careful per-slot path, which redistributes it or raises (Note [Per-slot rule]).
    """
    for p, v in zip(p_specs, v_specs):
        if v is p:
            continue
        if (
            (v.mesh is not p.mesh and v.mesh != p.mesh)
            or v.placements != p.placements
            or spec_dtype(v) != spec_dtype(p)
            or _spec_shape(v) != _spec_shape(p)
        ):
            return False
    return True


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
    ``state_steps`` are (cached on the tensors' identities, held weakly)."""
    cached = _ALIGNED.get(key)
    ids = tuple(map(id, values))
    if cached is not None and cached.check == ids:
        return True  # every cached tensor is alive (else the entry is gone): same objects
    if (
        not set(map(type, values)) <= PLAIN_TENSOR_TYPES
        or any(map(torch.Tensor.dim, values))
        or not {t.dtype for t in values} <= _STEP_DTYPES
    ):
        return False
    _ALIGNED.put(key, ids, None, values)
    return True


def locals_if_aligned(
    p_specs: tuple[DTensorSpec, ...] | None,
    values: list,
    specs_out: list | None,
    slot_key=None,
    *,
    scalars: bool = False,
) -> list[torch.Tensor] | None:
    """Local tensors of ``values`` if no slot needs redistribution or a careful check.

    A list passes when every entry is a DTensor with its param's mesh, placements, global shape
    and dtype (``p_specs`` are the params' specs from ``dtensor_specs(params,
    canonical_key=...)``, ``None`` when some param is a plain tensor), or, only when ``scalars``
    (the list is the per-param ``state_steps``), when every entry is a plain 0-dim float tensor.
    A plain list anywhere else goes to the careful path, which checks each slot's shape (a 0-dim
    state where a param-shaped one belongs would make the kernel read out of bounds). Returns ``None`` (leaving
    ``specs_out`` untouched) when any slot needs the careful per-slot treatment. ``slot_key``
    names the argument (e.g. its schema position); see Note [Aligned-slot cache].
    """
    v_specs = dtensor_specs(values)
    if v_specs is None:
        key = (slot_key, "scalars", len(values), id(values[0]) if values else None)
        if not scalars or not _plain_scalars_ok(key, values):
            return None
        if specs_out is not None:
            specs_out.extend([None] * len(values))
        return list(values)
    if p_specs is None:
        return None
    key = (slot_key, id(p_specs), len(values))
    cached = _ALIGNED.get(key)
    if cached is None or not (
        cached.check[0]() is p_specs and _same_specs(cached.check[1], v_specs)
    ):
        if len(v_specs) != len(p_specs) or not _specs_aligned(p_specs, v_specs):
            return None
        p_ref = weakref.ref(p_specs) if isinstance(p_specs, SpecList) else (lambda: None)
        _ALIGNED.put(key, (p_ref, v_specs), None, values)
    if specs_out is not None:
        specs_out.extend(v_specs)
    return [v._local_tensor for v in values]


def device_has_foreach_support(device: torch.device) -> bool:
    """``torch.utils._foreach_utils._device_has_foreach_support``: can foreach kernels run here?"""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return _device_has_foreach_support(device)


_ORIGINAL_TORCH_FUNCTIONS: dict[str, Callable] = {}


def patch_torch_function(name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``torch.<name>`` by ``make_wrapper(original)`` (idempotent: the wrapper always
    wraps torch's own function, never an earlier wrapper).

    Used for the four in-place fused optimizer entry points that ``torch.optim`` looks up as
    ``torch._fused_adam_`` and friends at every step, so that DTensor args reach our handler
    without the generic ``__torch_dispatch__`` round trip; see Note [Fused fast entry].
    """
    if name not in _ORIGINAL_TORCH_FUNCTIONS:
        _ORIGINAL_TORCH_FUNCTIONS[name] = getattr(torch, name)
    setattr(torch, name, make_wrapper(_ORIGINAL_TORCH_FUNCTIONS[name]))


def unpatch_torch_function(name: str) -> None:
    """Put torch's own ``torch.<name>`` back (the same object); a no-op if never patched."""
    original = _ORIGINAL_TORCH_FUNCTIONS.get(name)
    if original is not None:
        setattr(torch, name, original)


# Optimizer.__dict__ entry (the staticmethod object itself), saved at the first patch.
_ORIGINAL_GROUPING: list = []
_GROUPING_ATTR = "_group_tensors_by_device_and_dtype"


def patch_optimizer_grouping(make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``torch.optim.Optimizer._group_tensors_by_device_and_dtype`` (a private
    staticmethod that every foreach/fused ``torch.optim`` functional calls once per step to
    bucket its tensor lists by device and dtype) by ``make_wrapper(original)``, idempotently.

    See Note [Local grouping] in ``dtensor_moe/optim/fast_step.py``.
    """
    if not _ORIGINAL_GROUPING:
        _ORIGINAL_GROUPING.append(torch.optim.Optimizer.__dict__[_GROUPING_ATTR])
    original = _ORIGINAL_GROUPING[0].__func__
    setattr(torch.optim.Optimizer, _GROUPING_ATTR, staticmethod(make_wrapper(original)))


def unpatch_optimizer_grouping() -> None:
    """Put torch's own staticmethod object back; a no-op if never patched."""
    if _ORIGINAL_GROUPING:
        setattr(torch.optim.Optimizer, _GROUPING_ATTR, _ORIGINAL_GROUPING[0])


def optimizer_step_body_cell(optimizer_cls: type) -> Any | None:
    """The closure cell that holds the body of ``optimizer_cls.step``, or ``None``.

    torch 2.13 decorates ``Adam.step`` (which ``AdamW`` inherits), ``SGD.step`` and
    ``Adagrad.step`` with ``torch.optim.optimizer._use_grad_for_differentiable``, whose inner
    ``_use_grad`` sets grad mode, inserts the ``torch._dynamo.graph_break()`` calls that
    ``torch.compile`` relies on, and calls the undecorated body through its free variable
    ``func``. Setting that cell's ``cell_contents`` changes the body that every caller of
    ``step`` runs, without replacing ``step`` itself (and so without disturbing torch's
    profiling/hook wrapper, which is installed lazily around ``step``); see Note [Fast step].
    ``None`` when ``step`` does not have that shape (another torch release).
    """
    fn = optimizer_cls.step
    while getattr(getattr(fn, "__code__", None), "co_name", None) != "_use_grad":
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    free = fn.__code__.co_freevars
    if "func" not in free or fn.__closure__ is None:
        return None
    return fn.__closure__[free.index("func")]


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
