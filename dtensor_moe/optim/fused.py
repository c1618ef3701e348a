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
  hold 0-dim tensors beside param-shaped params, on every path (this handler, the fast entry
  and the local grouping of ``fast_step.py``).
* global scalars (a tensor ``lr``, ``grad_scale``, ``found_inf``) are plain tensors or
  replicated DTensors; they are passed to the kernel as local tensors and never decide a mesh.

When every slot already agrees, the handler only unwraps local tensors and calls the kernel
once: no sharding propagation, no collective. Argument positions are read from the op schema
by name (``state_steps`` is argument 5 for Adam but 3 for Adagrad; SGD has none).

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
import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_moe import _compat

__all__ = [
    "FUSED_OPS",
    "FusedOpLayout",
    "fast_paths_enabled",
    "fused_op_layout",
    "register_strategies",
    "set_fast_paths",
]

logger = logging.getLogger(__name__)
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
    overload returns (0 for in-place and ``.out`` overloads).
    """

    op: torch._ops.OpOverload
    list_args: tuple[tuple[str, int, bool], ...]
    scalar_args: tuple[tuple[str, int, bool], ...]
    num_result_lists: int


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
    return FusedOpLayout(
        op=op,
        list_args=tuple(list_args),
        scalar_args=tuple(scalar_args),
        num_result_lists=len(schema.returns),
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


def _local_list(op, arg: str, params: list, p_specs, values: list, specs_out):
    """Localize one tensor list, or validate it and return a :class:`_PendingList`.

    The fast path is a few C-level passes (Note [Aligned-slot cache]); no communication
    happens here, so every error is raised before the first collective of the step.
    """
    if len(values) == 0:
        return []
    if values is params and p_specs is not None:  # the params themselves: nothing to align
        if specs_out is not None:
            specs_out.extend(p_specs)
        return _compat.local_tensors(values)
    if len(values) != len(params):
        raise ValueError(
            f"{op}: '{arg}' has {len(values)} tensors but 'self' has {len(params)} params; "
            "each list must be empty or have one tensor per param."
        )
    fast = _compat.locals_if_aligned(
        p_specs, values, specs_out, slot_key=(op, arg), scalars=arg == _STEPS_ARG
    )
    if fast is not None:
        return fast
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


def fused_optimizer_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict, kernel=None):
    """DTensor handler for every fused optimizer overload; see Note [Per-slot rule].

    ``kernel`` is what runs on the local tensors: ``op`` itself by default, or the equivalent
    ``torch._fused_*_`` function, whose Python binding is cheaper than an OpOverload call (see
    Note [Fused fast entry]).

    Communication: none when every slot already has its param's placements; otherwise the
    redistributions that align those slots, each on its own param's mesh.
    """
    layout = fused_op_layout(op)
    new_args, new_kwargs = list(args), dict(kwargs)
    params = _get_arg(args, kwargs, *layout.list_args[0])
    p_specs = _compat.dtensor_specs(params, canonical_key=op)
    specs_per_list: list[list] = []
    pending: list[tuple] = []
    for name, pos, kwarg_only in layout.list_args:  # validate everything, no communication
        values = _get_arg(args, kwargs, name, pos, kwarg_only)
        if values is None:
            continue
        specs = [] if len(specs_per_list) < layout.num_result_lists else None
        if specs is not None:
            specs_per_list.append(specs)
        local = _local_list(op, name, params, p_specs, values, specs)
        if isinstance(local, _PendingList):
            pending.append((name, pos, kwarg_only, local, specs))
        else:
            _set_arg(new_args, new_kwargs, name, pos, kwarg_only, local)
    for name, pos, kwarg_only in layout.scalar_args:
        value = _get_arg(args, kwargs, name, pos, kwarg_only)
        if value is not None:
            _set_arg(new_args, new_kwargs, name, pos, kwarg_only, _local_scalar(op, name, value))
    write_backs: list[_WriteBack] = []
    for name, pos, kwarg_only, plan, specs in pending:  # then align, each on its own mesh
        _set_arg(new_args, new_kwargs, name, pos, kwarg_only, _resolve(plan, write_backs, specs))
    result = (kernel or op)(*new_args, **new_kwargs)
    _write_back(write_backs)
    if layout.num_result_lists == 0:
        return result
    return _wrap_results(result, specs_per_list)


# Note [Fused fast entry]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.optim`` calls ``torch._fused_adam_`` (and the AdamW, SGD and Adagrad twins) once per
# step. With DTensor args that call goes through DTensor's generic ``__torch_dispatch__``, which
# boxes every tensor of every list before it reaches our handler: about as much time as the
# kernel itself for 200 small params. We wrap those four torch functions: when no autograd
# graph is being recorded, nothing is being compiled and a param is a DTensor, the wrapper calls
# :func:`fused_optimizer_handler` directly with the overload the binding would have picked.
# Everything else (plain tensors, grad mode, tracing) goes to torch's original function, whose
# DTensor dispatch reaches the same handler, so results are identical either way.
_FAST_ENTRY_NAMES = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


def _has_dtensor(params: list) -> bool:
    if not params:
        return False
    return type(params[0]) is DTensor or DTensor in set(map(type, params))


def _make_fast_entry(name: str):
    packet = getattr(aten, name)

    def make(original):
        def fused_entry(*args, **kwargs):
            if (
                torch.compiler.is_compiling()  # first: dynamo then traces nothing else here
                or not args
                or torch.is_grad_enabled()
                or not _has_dtensor(args[0])
            ):
                return original(*args, **kwargs)
            op = packet.tensor_lr if isinstance(kwargs.get("lr"), torch.Tensor) else packet.default
            return fused_optimizer_handler(op, args, kwargs, kernel=original)

        fused_entry.__name__ = fused_entry.__qualname__ = name
        fused_entry.__doc__ = f"dtensor_moe fast entry for torch.{name}; see docs/optimizers.md."
        fused_entry.__wrapped__ = original
        return fused_entry

    return make


# Note [Switchable fast paths]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The import makes two kinds of global change (listed in docs/optimizers.md):
#
# * correctness: DTensor's custom-op handler for every fused optimizer overload (Note [Per-slot
#   rule]) and for GradScaler's inf check (Note [GradScaler across meshes]). Without them, fused
#   optimizers fail or silently disagree across meshes; they are always installed.
# * speed only: the fast entry (Note [Fused fast entry]), the fast step body and the local
#   grouping (Note [Fast step], Note [Local grouping]). Results are bit-identical with and
#   without them (tests run both ways). ``DTENSOR_MOE_FAST_PATHS=0`` in the environment at
#   import leaves them out; :func:`set_fast_paths` installs or removes them at run time, and
#   removing puts torch's own objects back (``torch._fused_adam_ is`` torch's function again).
_FAST_PATHS_ENV = "DTENSOR_MOE_FAST_PATHS"
_ENV_OFF = ("0", "false", "off", "no")
_ENV_ON = ("", "1", "true", "on", "yes")


def _fast_paths_from_env() -> bool:
    raw = os.environ.get(_FAST_PATHS_ENV, "")
    value = raw.strip().lower()
    if value not in _ENV_OFF + _ENV_ON:
        raise ValueError(
            f"{_FAST_PATHS_ENV}={raw!r} is not understood; set it to 0 to leave dtensor_moe's "
            "speed-only patches out, or to 1 (or leave it unset) to install them."
        )
    return value in _ENV_ON


_FAST_PATHS = _fast_paths_from_env()
_REGISTERED = False


def fast_paths_enabled() -> bool:
    """Whether dtensor_moe's speed-only patches are installed (Note [Switchable fast paths])."""
    return _FAST_PATHS


def set_fast_paths(enabled: bool) -> None:
    """Install (``True``) or remove (``False``) the speed-only patches, at run time.

    Removing them restores the very objects torch shipped: ``torch._fused_adam_``,
    ``torch._fused_adamw_``, ``torch._fused_sgd_``, ``torch._fused_adagrad_``,
    ``torch.optim.Optimizer._group_tensors_by_device_and_dtype`` and the body of ``step`` of
    Adam/AdamW, SGD and Adagrad. The DTensor handlers (needed for correctness) stay. Results are
    bit-identical either way; only the per-step overhead over DTensor params changes. Call it
    between steps, not from inside one. See Note [Switchable fast paths].
    """
    global _FAST_PATHS
    if not isinstance(enabled, bool):
        raise TypeError(f"set_fast_paths expects True or False, got {enabled!r}")
    _FAST_PATHS = enabled
    if enabled:
        _install_fast_paths()
    else:
        _uninstall_fast_paths()


def _install_fast_paths() -> None:
    from dtensor_moe.optim.fast_step import install_fast_step

    for name in _FAST_ENTRY_NAMES:
        _compat.patch_torch_function(name, _make_fast_entry(name))
    install_fast_step()


def _uninstall_fast_paths() -> None:
    from dtensor_moe.optim.fast_step import uninstall_fast_step

    for name in _FAST_ENTRY_NAMES:
        _compat.unpatch_torch_function(name)
    uninstall_fast_step()


def register_strategies() -> None:
    """Install the DTensor handlers for every fused optimizer overload (idempotent).

    Called when ``dtensor_moe`` is imported. Replaces torch's own rules for the fused Adam and
    AdamW overloads (logged at INFO) and adds the missing SGD, Adagrad and ``.out`` ones, plus
    the GradScaler inf-check handler of :mod:`dtensor_moe.optim.scaler`. Unless the fast paths
    are off (Note [Switchable fast paths]), also wraps the four in-place ``torch._fused_*_``
    entry points (Note [Fused fast entry]), the body of ``step`` of Adam, AdamW, SGD and Adagrad
    and torch.optim's tensor grouping (Note [Fast step] in ``fast_step.py``). Clears DTensor's
    sharding-propagation cache so the change takes effect at once.
    """
    global _REGISTERED
    from dtensor_moe.optim.scaler import register_found_inf_handler

    handlers = _compat.custom_op_handlers()
    replaced = [op for op in FUSED_OPS if handlers.get(op) not in (None, fused_optimizer_handler)]
    for op in FUSED_OPS:
        handlers[op] = fused_optimizer_handler
    register_found_inf_handler()
    if _FAST_PATHS:
        _install_fast_paths()
    if not _REGISTERED:
        logger.info(
            "dtensor_moe: installed DTensor handlers for %d fused optimizer overloads "
            "(replacing custom handlers of %s; torch's sharding rules for fused Adam/AdamW "
            "are bypassed); speed-only patches %s", len(FUSED_OPS),
            [str(op) for op in replaced] or "none", "on" if _FAST_PATHS else "off",
        )
    _REGISTERED = True
    _compat.clear_sharding_prop_cache()
