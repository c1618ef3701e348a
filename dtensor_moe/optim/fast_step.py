"""A cheaper ``step()`` for torch.optim's Adam, AdamW, SGD and Adagrad over DTensor params.

Note [Fast step]
~~~~~~~~~~~~~~~~
``torch.optim`` reads a few attributes of every param at every step (``p.grad``,
``torch.is_complex(p)``, ``p.grad.is_sparse``, the device and dtype when it groups tensors).
On a tensor subclass each of those first looks up the instance's ``__torch_function__``, which
makes the per-param bookkeeping of a step over 200 small DTensors about twice as slow as over
plain tensors. DTensor's and ``nn.Parameter``'s ``__torch_function__`` is torch's disabled
implementation, so that lookup never changes what happens: it only costs time.

``install_fast_step`` wraps the *body* of ``step`` of the four optimizer classes. When

* no closure is given (a closure runs the forward and backward, which may use any subclass),
* nothing is being compiled, and
* every param of every group is a DTensor whose local tensor is a plain ``torch.Tensor``, or a
  plain ``torch.Tensor`` / ``nn.Parameter``, and at least one param is a DTensor,

the wrapped step runs under ``DisableTorchFunctionSubclass``, which skips exactly that lookup.
torch function *modes* still run, and DTensor's ``__torch_dispatch__`` (where DTensor's work
happens) is unaffected, so results are bit-for-bit those of the unwrapped step; a test checks
this and counts collectives. Any other step (plain tensors only, other subclasses, a closure)
calls torch's ``step`` unchanged. Whether the params qualify is decided again only when a
group's param list changes (:func:`fast_step_applies`).

Where the wrapper sits. torch decorates each ``step`` with ``_use_grad_for_differentiable``,
whose inner ``_use_grad`` sets grad mode, calls ``torch._dynamo.graph_break()`` and then calls the
undecorated body held in its closure cell ``func``; torch's profiling wrapper (which runs the step
hooks) is put around ``step`` lazily, when the first optimizer of a class is created. We replace
neither. ``install_fast_step`` registers one global step pre-hook (:func:`_arm_fast_step`, public
``torch.optim.optimizer.register_optimizer_step_pre_hook``). For an eager step without a closure
whose params qualify, it puts the fast body into that closure cell
(``_compat.optimizer_step_body_cell``) for this one call; the fast body puts torch's body back
first thing, before it runs, so the cell holds torch's body again even if the step raises. So

* ``Adam.step`` & co. stay the very objects torch created, whatever the order of ``import
  dtensor_moe`` and optimizer creation. Global pre-hooks run before the optimizer's own, which
  run before the body, so every step hook runs outside the fast region;
* turning the fast paths off removes the hook: exactly torch's ``step`` again, and torch's
  profiling wrapper around it is untouched;
* under ``torch.compile`` the hook does nothing, so dynamo sees torch's own body in the cell,
  with no frame of ours on the stack. A compiled step has torch's graphs, graph breaks and
  frames, for-loop, foreach and fused alike (``tests/test_optim_no_harm.py`` pins them against
  a fresh interpreter without dtensor_moe). An earlier version kept the wrapper in the cell at
  all times. Dynamo then inlined it: one more frame on the stack at the break that torch makes at
  its dynamo-disabled ``_fused_adam``, hence one more break and one more frame per fused step.
* Another thread that steps an optimizer of the same class while the cell is armed runs the
  fast body, which checks again whether its own params qualify and otherwise calls torch's body
  unchanged: the results stay torch's either way.

Note [Local grouping]
~~~~~~~~~~~~~~~~~~~~~
Inside a fast step where every param group is ``fused``, torch.optim's functional (``_fused_adam``
and its SGD/Adagrad twins) hands its per-slot lists (params, grads, states, ``state_steps``) to
``Optimizer._group_tensors_by_device_and_dtype`` and calls the fused kernel on what comes back.
When every list is already aligned with the params (the fast path of Note [Per-slot rule]:
each DTensor has its param's mesh, placements and dtype, ``state_steps`` are plain 0-dim float
tensors), our wrapper of that grouping function returns the *local* tensors instead. The kernel
then runs on plain tensors directly, exactly as the DTensor handler would have run it after
unwrapping the same lists, and neither the grouping nor the handler pays per-DTensor costs.
When the params' *local* tensors all sit on one device with one dtype (checked once per set of
local tensors, :func:`single_group_key`; aligned lists have the params' dtypes), the wrapper
returns that one group itself instead of walking every tensor again. The devices are those of
the local tensors, not of the mesh: under FSDP2 with ``CPUOffloadPolicy`` on some modules, params
of one CUDA mesh keep their local shards on the CPU, and those must form their own group, as
torch's grouping makes them. Otherwise torch's grouping buckets the local tensors. Any list that is not aligned (a slot to
redistribute, another mesh or dtype, a DTensor step counter) makes the wrapper return torch's
grouping of the DTensors unchanged, so the handler validates, redistributes and writes back, or
raises, as always. Outside a fused fast step the wrapper calls torch's function unchanged.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtensor_moe import _compat

__all__ = [
    "FAST_STEP_CLASSES",
    "clear_caches",
    "fast_step_applies",
    "install_fast_step",
    "local_lists_if_aligned",
    "single_group_key",
    "uninstall_fast_step",
]

FAST_STEP_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ALLOWED_PARAM_TYPES = _compat.PLAIN_TENSOR_TYPES | {DTensor}
_MARK = "_dtensor_moe_fast_step"

# Note [Fast-step caches]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ============  =================================  ==============================================
# cache         key -> value                       bound and lifetime
# ============  =================================  ==============================================
# _GROUP_KEYS   (len, id(first local param)) ->    64 entries (emptied when full); an entry is
#               (device, dtype) or None, checked   dropped as soon as one of its local tensors
#               on the ids of all local params     dies (weak references; Note [Caches hold no
#                                                  tensors] in _compat.py)
# ============  =================================  ==============================================
# ``clear_caches()`` empties it. Whether an optimizer's params qualify for the fast step is not
# a module-level cache: it is kept on the optimizer itself, in the attribute ``_VERDICT_ATTR``
# (its param lists when checked, and the verdict), so it lives and dies with the optimizer and
# holds nothing the optimizer does not hold already.
_GROUP_KEYS = _compat.GuardedCache(64)
_VERDICT_ATTR = "_dtensor_moe_fast_step_verdict"


def clear_caches() -> None:
    """Empty the fast-step caches (Note [Fast-step caches]); the next step rebuilds them."""
    _GROUP_KEYS.clear()


def _same_params(cached: tuple, groups: list) -> bool:
    if len(cached) != len(groups):
        return False
    for old, group in zip(cached, groups):
        params = group["params"]
        if len(old) != len(params) or not all(map(operator.is_, old, params)):
            return False
    return True


def fast_step_applies(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` may skip subclass ``__torch_function__`` lookups.

    True when every param is a DTensor over a plain local tensor or a plain tensor, and at least
    one is a DTensor; see Note [Fast step]. The verdict is kept until a group's param list
    changes (one identity pass per step).
    """
    groups = optimizer.param_groups
    cached = getattr(optimizer, _VERDICT_ATTR, None)
    if cached is not None and _same_params(cached[0], groups):
        return cached[1]
    verdict = _check_params(groups)
    # on the optimizer itself: it holds these params anyway, and the verdict dies with it
    setattr(optimizer, _VERDICT_ATTR, (tuple(tuple(g["params"]) for g in groups), verdict))
    return verdict


def _check_params(groups: list) -> bool:
    any_dtensor = False
    for group in groups:
        params = group["params"]
        types = set(map(type, params))
        if not types <= _ALLOWED_PARAM_TYPES:
            return False
        if DTensor in types:
            any_dtensor = True
            dtensors = params if len(types) == 1 else [p for p in params if type(p) is DTensor]
            if not set(map(type, _compat.local_tensors(dtensors))) <= _compat.PLAIN_TENSOR_TYPES:
                return False
    return any_dtensor


class _StepState(threading.local):
    local_grouping = False  # inside a fast step whose groups are all fused
    # (index of ``state_steps``, number of lists) in the grouping call of the running fused
    # step (None: no such list); only that list may hold plain 0-dim tensors (Note [Per-slot
    # rule] in fused.py)
    steps_list: tuple[int, int] | None = None
    # the optimizer that _arm_fast_step just found eligible on this thread; the fast body takes
    # (and clears) it instead of checking the params a second time
    armed_for: torch.optim.Optimizer | None = None


# Where ``state_steps`` sits in the lists each fused step hands to torch's grouping (torch 2.13:
# Adam/AdamW ``[params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps]``, Adagrad
# ``[params, grads, state_sums, state_steps]``, SGD none). Keyed by the class whose ``step``
# body it is (AdamW inherits Adam's). A call with another number of lists matches nothing, and
# its plain lists then take the careful path.
_STEPS_LIST: dict[type, tuple[int, int] | None] = {
    torch.optim.Adam: (5, 6),
    torch.optim.Adagrad: (3, 4),
    torch.optim.SGD: None,
}


_STATE = _StepState()


def _wrap_body(cell, body, steps_list: tuple[int, int] | None):
    """The fast version of an optimizer's undecorated ``step`` body (Note [Fast step]), for one
    call: :func:`_arm_fast_step` puts it into ``cell`` and it puts ``body`` back first thing.

    ``steps_list``: where ``state_steps`` sits in the lists that the fused step of this body
    hands to torch's grouping function (``_STEPS_LIST``).
    """

    @functools.wraps(body)
    def fast_step(self, closure=None):
        cell.cell_contents = body  # armed for this call only
        armed_for, _STATE.armed_for = _STATE.armed_for, None
        if closure is None and not torch.compiler.is_compiling() and (
            armed_for is self or fast_step_applies(self)  # another thread's arming: check
        ):
            outer = _STATE.local_grouping, _STATE.steps_list
            _STATE.local_grouping = all(g.get("fused") for g in self.param_groups)
            _STATE.steps_list = steps_list
            try:
                with _compat.subclass_torch_function_disabled():
                    return body(self)
            finally:
                _STATE.local_grouping, _STATE.steps_list = outer
        return body(self, closure)

    setattr(fast_step, _MARK, True)
    return fast_step


def _arm_fast_step(optimizer, args, kwargs):
    """Global optimizer step pre-hook: arms the fast body for this call when it applies.

    Runs before the optimizer's own pre-hooks, so they stay outside the fast region, as do the
    post-hooks. Does nothing while compiling: dynamo then sees torch's own body in the cell,
    with no extra frame (Note [Fast step]).
    """
    if torch.compiler.is_compiling():
        return None
    armed = _ARMED.get(type(optimizer), _UNKNOWN)
    if armed is _UNKNOWN:
        cell = _compat.optimizer_step_body_cell(type(optimizer))
        armed = next((w for c, _, w in _body_cells() if c is cell), None)
        _ARMED[type(optimizer)] = armed
    if armed is None or len(args) > 1 or kwargs.get("closure") is not None:
        return None
    if fast_step_applies(optimizer):
        _STATE.armed_for = optimizer  # this thread's verdict, taken by the fast body
        armed[0].cell_contents = armed[1]
    return None


def local_lists_if_aligned(tensorlistlist: list) -> tuple[tuple, list] | None:
    """The params' specs and the local tensors of every list, if all lists are aligned with
    the params (the first list): same mesh, placements, global shape and dtype slot by slot,
    and plain 0-dim float ``state_steps``.

    ``None`` when any list needs the careful per-slot treatment of the DTensor handler; see
    Note [Local grouping]. Empty lists and all-``None`` lists (SGD without momentum) pass as
    they are. No communication.
    """
    params = tensorlistlist[0]
    p_specs = _compat.dtensor_specs(params, canonical_key="local-grouping")
    if p_specs is None:
        return None
    out = [_compat.local_tensors(params)]
    for idx in range(1, len(tensorlistlist)):
        values = tensorlistlist[idx]
        if len(values) == 0:
            out.append([])
            continue
        if len(values) != len(params):
            return None
        if values[0] is None:
            if not all(map(operator.is_, values, itertools.repeat(None))):
                return None
            out.append(list(values))  # new lists, as torch's grouping returns
            continue
        local = _compat.locals_if_aligned(
            p_specs, values, None, slot_key=("local-grouping", idx),
            scalars=(idx, len(tensorlistlist)) == _STATE.steps_list,
        )
        if local is None:
            return None
        out.append(local)
    return p_specs, out


def single_group_key(local_params: list[torch.Tensor]) -> tuple | None:
    """``(device, dtype)`` when every local param tensor sits on one device with one dtype,
    else ``None`` (Note [Local grouping]).

    Read from the local tensors themselves, once per set of local tensors: the verdict is kept
    while the same tensor objects come back (compared by ``id``; the entry is dropped as soon as
    one of them dies, so an ``id`` cannot be reused by another tensor while it is kept).
    """
    ids = tuple(map(id, local_params))
    key = (len(ids), ids[0])
    cached = _GROUP_KEYS.get(key)
    if cached is not None and cached.check == ids:
        return cached.value
    pairs = {(t.device, t.dtype) for t in local_params}
    value = next(iter(pairs)) if len(pairs) == 1 else None
    _GROUP_KEYS.put(key, ids, value, local_params)
    return value


def _make_local_grouping(original):
    def group_tensors_by_device_and_dtype(tensorlistlist, with_indices=False):
        if (
            not torch.compiler.is_compiling()
            and _STATE.local_grouping
            and tensorlistlist
            and tensorlistlist[0]
        ):
            aligned = local_lists_if_aligned(tensorlistlist)
            if aligned is not None:
                _, local = aligned
                key = single_group_key(local[0])
                if key is None:
                    return original(local, with_indices)
                indices = list(range(len(local[0]))) if with_indices else []
                return {key: (local, indices)}
        return original(tensorlistlist, with_indices)

    group_tensors_by_device_and_dtype.__wrapped__ = original
    group_tensors_by_device_and_dtype.__doc__ = (
        "dtensor_moe wrapper; see Note [Local grouping] in dtensor_moe/optim/fast_step.py."
    )
    return group_tensors_by_device_and_dtype


# For each distinct ``step`` body of FAST_STEP_CLASSES: (closure cell, torch's original body,
# (cell, fast wrapper of that body)).
_BODIES: list[tuple] = []
# optimizer class -> (cell, fast wrapper) of its ``step`` body, or None when its ``step`` is not
# one of ours (a subclass with its own ``step``, another optimizer). Keyed by class: classes
# live as long as the program, and there are a handful.
_ARMED: dict[type, tuple | None] = {}
_UNKNOWN = object()
_HOOK: list = []  # the RemovableHandle of the installed pre-hook, if any


def _body_cells() -> list[tuple]:
    if not _BODIES:
        seen: set[int] = set()
        for cls in FAST_STEP_CLASSES:
            cell = _compat.optimizer_step_body_cell(cls)
            if cell is None or id(cell) in seen:
                continue  # AdamW inherits Adam.step; another torch release may differ
            seen.add(id(cell))
            body = cell.cell_contents
            while getattr(body, _MARK, False):  # a wrapper left by an earlier copy of us
                body = body.__wrapped__
            owner = next(c for c in _STEPS_LIST if issubclass(cls, c))
            _BODIES.append((cell, body, (cell, _wrap_body(cell, body, _STEPS_LIST[owner]))))
    return _BODIES


def install_fast_step() -> None:
    """Register the pre-hook that arms the fast ``step`` body of :data:`FAST_STEP_CLASSES`,
    and wrap torch.optim's tensor grouping (idempotent); see Note [Fast step] and Note [Local
    grouping]."""
    _body_cells()
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_arm_fast_step))
    _compat.patch_optimizer_grouping(_make_local_grouping)


def uninstall_fast_step() -> None:
    """Remove the pre-hook, and put torch's own ``step`` bodies (should one be armed) and
    grouping function back (the same objects)."""
    while _HOOK:
        _HOOK.pop().remove()
    for cell, body, _ in _BODIES:
        cell.cell_contents = body
    _compat.unpatch_optimizer_grouping()
