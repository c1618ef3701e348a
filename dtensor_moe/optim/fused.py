"""DTensor handlers for the fused optimizer ops, across any number of device meshes.

Note [Per-slot rule]
~~~~~~~~~~~~~~~~~~~~
A fused optimizer op takes parallel tensor lists: ``self`` (the params), ``grads``, state lists
(``exp_avgs``, ``momentum_buffer_list``, ``state_sums``, ...), per-param scalar lists
(``state_steps``) and, for ``.out`` overloads, ``out``. Slot *i* of every list belongs to param
*i*, so each slot is handled on its own param's mesh:

* a tensor in slot *i* must live on param *i*'s mesh; a different mesh is a user error
  (``ValueError`` naming the slot, the argument and both meshes). Nothing ever moves across
  meshes, and the check runs before any communication, so every rank fails the same way.
* a tensor in a per-param state list (grads, ``exp_avgs``, ...) must have the param's global
  shape; any other shape, a 0-dim tensor included, is a ``ValueError`` naming the slot (the
  kernel would read past the smaller tensor). It must carry the param's placements; if it
  carries other placements on the same mesh, it is redistributed on that mesh only, the op
  runs, and mutated arguments are written back in their original placements.
* an entry of the per-param scalar list ``state_steps`` must be 0-dim: ``Replicate`` on the
  param's mesh, or a plain tensor (which is what ``torch.optim`` creates). Only that list may
  hold 0-dim tensors beside param-shaped params.
* global scalars (a tensor ``lr``, ``grad_scale``, ``found_inf``) are plain tensors or
  replicated DTensors; they are passed to the kernel as local tensors and never decide a mesh.

When every slot already agrees, the handler only unwraps local tensors and calls the kernel
once: no sharding propagation, no collective (Note [Handler cost]). Argument positions are read
from the op schema by name (``state_steps`` is argument 5 for Adam but 3 for Adagrad; SGD has
none).

Note [Out-of-place results]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The out-of-place overloads (``_fused_adam.default`` and friends) return one list per leading
input list (``self_out``, ``grads_out``, ...). Result *j* slot *i* is wrapped with the spec of
input list *j* slot *i* after it was aligned with its param, so it has the param's mesh and
placements. ``.out`` overloads write the new params into ``out``, whose slots follow ``self``.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_moe import _compat

__all__ = [
    "FUSED_OPS",
    "FusedOpLayout",
    "fused_op_layout",
    "fused_optimizer_handler",
    "register_strategies",
]

logger = logging.getLogger(__name__)
_REGISTERED = False  # whether register_strategies has logged its first registration
aten = torch.ops.aten
_STEPS_ARG = "state_steps"  # the one per-param list of 0-dim tensors (Note [Per-slot rule])

_FUSED_PACKETS = (
    "_fused_adam_",
    "_fused_adam",
    "_fused_adamw_",
    "_fused_adamw",
    "_fused_sgd_",
    "_fused_sgd",
    "_fused_adagrad_",
    "_fused_adagrad",
)
_IN_PLACE_PACKETS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
_OVERLOADS = ("default", "tensor_lr", "out", "tensor_lr_out")
_GLOBAL_SCALARS = ("lr", "grad_scale", "found_inf")


def _all_fused_ops() -> tuple[torch._ops.OpOverload, ...]:
    ops = []
    for name in _FUSED_PACKETS:
        packet = getattr(aten, name)
        ops.extend(getattr(packet, ov) for ov in _OVERLOADS if ov in packet.overloads())
    return tuple(ops)


FUSED_OPS: tuple[torch._ops.OpOverload, ...] = _all_fused_ops()


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOpLayout:
    """Where the arguments of one fused-op overload sit, read from its schema by name.

    ``list_args`` holds ``(name, position, kwarg_only)`` for every ``Tensor[]`` argument in
    schema order; the first is always ``self`` (the params). ``scalar_args`` holds the same for
    the global ``Tensor``/``Tensor?`` arguments. ``num_result_lists`` is how many lists the
    overload returns (0 for in-place and ``.out`` overloads). ``kernel`` is what the handler calls
    on the local tensors: for the in-place overloads, torch's Python binding of the op
    (``torch._fused_adam_`` and friends, which pick the ``default`` or ``tensor_lr`` overload from
    the type of ``lr`` as the dispatcher did); for the others, the overload itself.
    """

    op: torch._ops.OpOverload
    list_args: tuple[tuple[str, int, bool], ...]
    scalar_args: tuple[tuple[str, int, bool], ...]
    num_result_lists: int
    kernel: Callable


@functools.cache
def fused_op_layout(op: torch._ops.OpOverload) -> FusedOpLayout:
    """Build (once per overload) the :class:`FusedOpLayout` of ``op`` from ``op._schema``.

    Cached for the life of the process: keyed by the overload (``OpOverload`` objects are
    immortal), at most one entry per overload of :data:`FUSED_OPS` (24), and the layouts hold
    nothing but the op and argument names and positions.
    """
    list_args, scalar_args = [], []
    schema = _compat.schema_of(op)
    for pos, arg in enumerate(schema.arguments):
        type_str = str(arg.type)
        entry = (arg.name, pos, arg.kwarg_only)
        if type_str == "List[Tensor]":
            list_args.append(entry)
        elif type_str in ("Tensor", "Optional[Tensor]"):
            scalar_args.append(entry)
    if not list_args or list_args[0][0] != "self":
        raise AssertionError(f"{op}: expected the params list 'self' first, got {list_args}")
    unknown = [name for name, _, _ in scalar_args if name not in _GLOBAL_SCALARS]
    if unknown:
        raise AssertionError(f"{op}: unexpected global tensor arguments {unknown}")
    packet = op.overloadpacket.__name__
    return FusedOpLayout(
        op=op,
        list_args=tuple(list_args),
        scalar_args=tuple(scalar_args),
        num_result_lists=len(schema.returns),
        # the binding parses its arguments in generated C++, where an OpOverload call matches
        # them against the schema: about 0.15 us less per tensor (Note [Handler cost])
        kernel=getattr(torch, packet) if packet in _IN_PLACE_PACKETS else op,
    )


def _get_arg(args: tuple, kwargs: dict, name: str, pos: int, kwarg_only: bool):
    if not kwarg_only and pos < len(args):
        return args[pos]
    return kwargs.get(name)


def _set_arg(args: list, kwargs: dict, name: str, pos: int, kwarg_only: bool, value) -> None:
    if not kwarg_only and pos < len(args):
        args[pos] = value
    else:
        kwargs[name] = value


def _describe(t: object) -> str:
    if isinstance(t, DTensor):
        spec = _compat.spec_of(t)
        return f"DTensor on {spec.mesh} with placements {spec.placements}"
    return "torch.Tensor (not a DTensor)"


def _slot_error(op, arg: str, slot: int, param, value, why: str) -> ValueError:
    return ValueError(
        f"{op}: slot {slot} of '{arg}' does not follow param {slot}: {why}. "
        f"param {slot} is a {_describe(param)}; '{arg}'[{slot}] is a {_describe(value)}. "
        "Every tensor in slot i of a fused optimizer op must live on param i's device mesh "
        "(tensors are never moved across meshes); create optimizer state with "
        "torch.zeros_like(param) and keep each grad on its param's mesh."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _WriteBack:
    """A mutated argument that was redistributed to its param's placements before the op."""

    original: DTensor
    aligned: DTensor


def _slot_target(op, arg: str, slot: int, param, value) -> tuple | None:
    """Validate one slot (no communication); see Note [Per-slot rule].

    Returns ``None`` when ``value`` can be used as it is, else the placements (on the param's
    mesh) to redistribute it to.
    """
    p_is_dt = isinstance(param, DTensor)
    steps = arg == _STEPS_ARG
    if steps and value.dim() != 0:
        raise _slot_error(op, arg, slot, param, value, "a state_steps entry must be 0-dim")
    if not steps and value.shape != param.shape:
        raise _slot_error(
            op, arg, slot, param, value,
            f"its shape {tuple(value.shape)} differs from the param's {tuple(param.shape)}",
        )
    if not isinstance(value, DTensor):
        if p_is_dt and not steps:
            raise _slot_error(op, arg, slot, param, value, "mixes DTensor and torch.Tensor")
        return None
    if not p_is_dt:
        raise _slot_error(op, arg, slot, param, value, "mixes torch.Tensor and DTensor")
    p_spec, v_spec = _compat.spec_of(param), _compat.spec_of(value)
    if v_spec.mesh is not p_spec.mesh and v_spec.mesh != p_spec.mesh:
        raise _slot_error(op, arg, slot, param, value, "it is on a different device mesh")
    target = (Replicate(),) * p_spec.mesh.ndim if steps else p_spec.placements
    return None if v_spec.placements == target else target


@dataclass(frozen=True, kw_only=True, slots=True)
class _PendingList:
    """A validated list with slots still to redistribute (after every list is validated)."""

    params: list
    values: list
    targets: list


# Note [Handler cost]
# ~~~~~~~~~~~~~~~~~~~
# torch.optim calls the fused kernel once per step with every param in its lists, so this handler
# runs once per step; the aligned case (every slot already follows its param) must cost little
# next to the kernel, with no cache kept between calls. Per list it reads each DTensor's spec
# and local tensor once (list comprehensions, which CPython specializes) and compares each slot's
# mesh (by identity), placements and global shape with its param's. A list whose specs are the
# very objects of a list already checked in this call (``exp_avg_sqs`` after ``exp_avgs``:
# torch.optim creates both with ``zeros_like(param)``, and DTensor gives both outputs the spec
# object of one cached sharding decision) is accepted by one identity pass. Plain ``state_steps``
# are checked by type and dimension only. The in-place kernel is called through torch's Python
# binding (``FusedOpLayout.kernel``), and the arguments are copied only where a list or scalar
# is replaced.
#
# Right after the kernel of the step before, these objects are out of the CPU caches, so the
# comparisons cost about 1 us per slot (the placements' ``__eq__`` is a pybind call) and are the
# larger part of the handler's time. With 200 small params the handler is roughly 40% of what a
# step over DTensor params costs more than over plain tensors; the rest is torch's (its dispatch
# into this handler and torch.optim's Python over DTensor objects; docs/optimizers.md, "What a
# step over DTensor params costs"). Remembering verified specs between steps would skip the
# comparisons, but the whole optimizer step is under 1% of a training step of the MoE demo, so
# no cache earns its keep here.
_PLAIN_STEP_TYPES = frozenset({torch.Tensor})


def _aligned(p_specs: list, v_specs: list, checked: list[list]) -> bool:
    """Whether slot i of ``v_specs`` has ``p_specs[i]``'s mesh, placements and global shape, for
    every i (see Note [Handler cost]). ``checked`` holds the spec lists already found aligned in
    this call, the params' first; a list found aligned is added to it."""
    for ref in checked:
        if all(map(operator.is_, v_specs, ref)):
            return True
    try:
        for p, v in zip(p_specs, v_specs):
            if v is not p and (
                v.mesh is not p.mesh
                or v.placements != p.placements
                or v.tensor_meta.shape != p.tensor_meta.shape
            ):
                return False
    except AttributeError:  # a spec without tensor metadata: the careful path decides
        return False
    checked.append(v_specs)
    return True


def _plain_steps(values: list) -> bool:
    """Whether ``values`` are plain 0-dim tensors, as ``torch.optim`` creates ``state_steps``."""
    return set(map(type, values)) <= _PLAIN_STEP_TYPES and not any(map(torch.Tensor.dim, values))


def _local_list(op, arg: str, params: list, p_specs, values: list, checked: list, specs_out):
    """The local tensors of one tensor list, or a :class:`_PendingList` to align slot by slot.

    The aligned case is a few passes over the list (Note [Handler cost]). No communication
    happens here, so every error is raised before the first collective of the step.
    """
    if len(values) != len(params):
        raise ValueError(
            f"{op}: '{arg}' has {len(values)} tensors but 'self' has {len(params)} params; "
            "each list must be empty or have one tensor per param."
        )
    if arg == _STEPS_ARG and _plain_steps(values):
        if specs_out is not None:
            specs_out.extend([None] * len(values))
        return values
    if p_specs is not None:
        v_specs = _compat.dtensor_specs(values)
        if v_specs is not None and _aligned(p_specs, v_specs, checked):
            if specs_out is not None:
                specs_out.extend(v_specs)
            return _compat.local_tensors(values)
    targets = [_slot_target(op, arg, i, p, v) for i, (p, v) in enumerate(zip(params, values))]
    return _PendingList(params=params, values=values, targets=targets)


def _resolve(pending: _PendingList, write_backs: list, specs_out) -> list:
    """Redistribute the slots of ``pending`` that need it, each on its own param's mesh."""
    local = []
    for param, value, target in zip(pending.params, pending.values, pending.targets):
        if target is not None:
            value = _redistribute(value, param, target, write_backs)
        is_dt = isinstance(value, DTensor)
        local.append(_compat.local_tensor(value) if is_dt else value)
        if specs_out is not None:
            specs_out.append(_compat.spec_of(value) if is_dt else None)
    return local


def _redistribute(value: DTensor, param: DTensor, target: tuple, write_backs: list) -> DTensor:
    aligned = value.redistribute(_compat.spec_of(param).mesh, target)
    write_backs.append(_WriteBack(original=value, aligned=aligned))
    return aligned


def _local_scalar(op, name: str, value):
    if not isinstance(value, DTensor):
        return value
    if not all(p.is_replicate() for p in value.placements):
        raise ValueError(
            f"{op}: the global scalar '{name}' is a DTensor with placements "
            f"{value.placements} on {value.device_mesh}; it must be a plain tensor or fully "
            "Replicate. Pass a plain tensor (e.g. torch.tensor(lr))."
        )
    return _compat.local_tensor(value)


def _write_back(write_backs: list) -> None:
    """Copy results of redistributed mutated arguments back into the user's tensors."""
    for wb in write_backs:
        placements = _compat.spec_of(wb.original).placements
        if any(p.is_partial() for p in placements):
            # A Partial layout cannot be produced by redistribute: adopt the aligned layout,
            # which holds the same global values.
            _compat.replace_dtensor_storage(wb.original, wb.aligned)
        else:
            back = wb.aligned.redistribute(wb.aligned.device_mesh, placements)
            _compat.local_tensor(wb.original).copy_(_compat.local_tensor(back))


def _wrap_results(result, specs_per_list: list) -> list:
    wrapped = []
    for out_list, specs in zip(result, specs_per_list):
        wrapped.append(
            [
                t if spec is None else _compat.dtensor_from_local_spec(t, spec)
                for t, spec in zip(out_list, specs)
            ]
        )
    return wrapped


def fused_optimizer_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """DTensor handler for every fused optimizer overload; see Note [Per-slot rule].

    Communication: none when every slot already has its param's placements; otherwise the
    redistributions that align those slots, each on its own param's mesh.
    """
    layout = fused_op_layout(op)
    params = _get_arg(args, kwargs, *layout.list_args[0])
    p_specs = _compat.dtensor_specs(params)
    new_args, new_kwargs = list(args), kwargs
    specs_per_list: list[list] = []
    pending: list[tuple] = []
    checked = [p_specs]
    for name, pos, kwarg_only in layout.list_args:  # validate everything, no communication
        values = _get_arg(args, kwargs, name, pos, kwarg_only)
        if values is None:
            continue
        specs = [] if len(specs_per_list) < layout.num_result_lists else None
        if specs is not None:
            specs_per_list.append(specs)
        if not values:
            continue
        if values is params and p_specs is not None:  # the params themselves
            local = _compat.local_tensors(params)
            if specs is not None:
                specs.extend(p_specs)
        else:
            local = _local_list(op, name, params, p_specs, values, checked, specs)
        if kwarg_only and new_kwargs is kwargs:
            new_kwargs = dict(kwargs)
        if isinstance(local, _PendingList):
            pending.append((name, pos, kwarg_only, local, specs))
        else:
            _set_arg(new_args, new_kwargs, name, pos, kwarg_only, local)
    for name, pos, kwarg_only in layout.scalar_args:
        value = _get_arg(args, kwargs, name, pos, kwarg_only)
        if isinstance(value, DTensor):
            if kwarg_only and new_kwargs is kwargs:
                new_kwargs = dict(kwargs)
            _set_arg(new_args, new_kwargs, name, pos, kwarg_only, _local_scalar(op, name, value))
    write_backs: list[_WriteBack] = []
    for name, pos, kwarg_only, plan, specs in pending:  # then align, each on its own mesh
        _set_arg(new_args, new_kwargs, name, pos, kwarg_only, _resolve(plan, write_backs, specs))
    result = layout.kernel(*new_args, **new_kwargs)
    _write_back(write_backs)
    if layout.num_result_lists == 0:
        return result
    return _wrap_results(result, specs_per_list)


# Note [Registration leaves torch's sharding cache alone]
# ``register_strategies`` only adds entries to DTensor's handler table, and DTensor looks there
# first: torch 2.13's C++ dispatch (``dispatchDTensorOp``) calls a handler before it builds a
# sharding-cache key, so an op whose sharding torch cached earlier goes to the new handler on
# its next call (``tests/test_sharding_cache_crash.py``). Clearing the caches would buy nothing
# and is not safe at every point: the C++ cache is a per-thread hash map whose lookup calls
# Python (``DTensorSpec.__eq__``), and a clear that runs inside a lookup on the same thread
# (from a GC or weakref callback, a ``__del__``, anything that Python can reach there) frees the
# entry being compared, and the process dies with SIGSEGV in the lookup (a key comparison,
# ``c10::IValue::equals`` or inlined). A clear also reaches only the calling thread's cache. So the
# package never clears torch's caches; ``_compat.clear_sharding_prop_cache`` is for tests that
# check what the caches keep alive, called between ops.


def register_strategies() -> None:
    """Install the DTensor handlers for every fused optimizer overload (idempotent).

    Called when ``dtensor_moe`` is imported. DTensor consults its handler table before its
    sharding rules, so the handler takes over the fused Adam and AdamW overloads from torch's
    rules (which stay registered; logged at INFO) and covers the SGD, Adagrad, out-of-place and
    ``.out`` ones that have none. Also installs the GradScaler inf-check handler of
    :mod:`dtensor_moe.optim.scaler`. These entries of DTensor's handler table are the only
    change it makes to torch (docs/optimizers.md, "Everything the import changes"). They take
    effect at once; torch's sharding-propagation caches are left alone (Note [Registration
    leaves torch's sharding cache alone]). No communication.
    """
    global _REGISTERED
    from dtensor_moe.optim.scaler import register_found_inf_handler

    handlers = _compat.custom_op_handlers()
    replaced = [op for op in FUSED_OPS if handlers.get(op) not in (None, fused_optimizer_handler)]
    for op in FUSED_OPS:
        handlers[op] = fused_optimizer_handler
    register_found_inf_handler()
    if not _REGISTERED:
        logger.info(
            "dtensor_moe: installed DTensor handlers for %d fused optimizer overloads "
            "(replacing custom handlers of %s; torch's sharding rules for fused Adam/AdamW "
            "are bypassed)", len(FUSED_OPS), [str(op) for op in replaced] or "none",
        )
    _REGISTERED = True
