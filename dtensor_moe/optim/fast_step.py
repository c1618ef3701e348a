"""A cheaper ``step()`` for torch.optim's Adam, AdamW, SGD and Adagrad over DTensor params.

Note [Fast step]
~~~~~~~~~~~~~~~~
``torch.optim`` reads a few attributes of every param at every step (``p.grad``,
``torch.is_complex(p)``, ``p.grad.is_sparse``, the device and dtype when it groups tensors).
On a tensor subclass each of those first looks up the instance's ``__torch_function__``, which
makes the per-param bookkeeping of a step over 200 small DTensors about twice as slow as over
plain tensors. DTensor's and ``nn.Parameter``'s ``__torch_function__`` is torch's disabled
implementation, so that lookup never changes what happens: it only costs time.

``install_fast_step`` wraps the ``step`` of the four optimizer classes. When

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

The wrapper sits inside torch's own profiling wrapper (which runs the step hooks) when
``dtensor_moe`` is imported before the first optimizer of a class is created, as usual. If an
optimizer of that class existed before the import, step hooks registered on it run inside the
fast region too; that only matters for hooks that rely on another subclass's
``__torch_function__``.

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
The specs also tell whether all params share one device type and dtype (checked once per spec
tuple); then every slot is on that device with that dtype, which is all torch's grouping would
establish, so the wrapper returns the one group itself instead of walking every tensor again.
Otherwise torch's grouping buckets the local tensors. Any list that is not aligned (a slot to
redistribute, another mesh or dtype, a DTensor step counter) makes the wrapper return torch's
grouping of the DTensors unchanged, so the handler validates, redistributes and writes back, or
raises, as always. Outside a fused fast step the wrapper calls torch's function unchanged.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import weakref

import torch
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat

__all__ = [
    "FAST_STEP_CLASSES",
    "fast_step_applies",
    "install_fast_step",
    "local_lists_if_aligned",
    "single_group_key",
]

FAST_STEP_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ALLOWED_PARAM_TYPES = _compat.PLAIN_TENSOR_TYPES | {DTensor}
_MARK = "_dtensor_moe_fast_step"
# optimizer -> (the params of each group when last checked, the verdict); see fast_step_applies.
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    cached = _VERDICTS.get(optimizer)
    if cached is not None and _same_params(cached[0], groups):
        return cached[1]
    verdict = _check_params(groups)
    _VERDICTS[optimizer] = (tuple(tuple(g["params"]) for g in groups), verdict)
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


_STATE = _StepState()


def _wrap_step(step):
    @functools.wraps(step)
    def fast_step(self, closure=None):
        if closure is None and not torch.compiler.is_compiling() and fast_step_applies(self):
            outer = _STATE.local_grouping
            _STATE.local_grouping = all(g.get("fused") for g in self.param_groups)
            try:
                with _compat.subclass_torch_function_disabled():
                    return step(self)
            finally:
                _STATE.local_grouping = outer
        return step(self, closure)

    setattr(fast_step, _MARK, True)  # functools.wraps copies it onto torch's profiling wrapper
    return fast_step


def local_lists_if_aligned(tensorlistlist: list) -> tuple[tuple, list] | None:
    """The params' specs and the local tensors of every list, if all lists are aligned with
    the params (the first list): same mesh, placements and dtype slot by slot, and plain 0-dim
    float ``state_steps``.

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
        local = _compat.locals_if_aligned(p_specs, values, None, slot_key=("local-grouping", idx))
        if local is None:
            return None
        out.append(local)
    return p_specs, out


# id(canonical param specs) -> (those specs, their one (device, dtype) group key or None)
_GROUP_KEYS: dict[int, tuple] = {}
_GROUP_KEYS_MAX = 64


def single_group_key(p_specs: tuple, first_local: torch.Tensor) -> tuple | None:
    """``(device, dtype)`` when every param lives on one device type with one dtype, else None.

    Read from the params' specs, once per canonical spec tuple (Note [Local grouping]); the
    device is that of the first param's local tensor, as torch's grouping would report it.
    (DTensors of one device type on a rank hold their local tensors on that rank's device;
    locals made on several devices of one type by hand would need torch's grouping.)
    """
    cached = _GROUP_KEYS.get(id(p_specs))
    if cached is not None and cached[0] is p_specs:
        return cached[1]
    dtypes = {_compat.spec_dtype(s) for s in p_specs}
    device_types = {s.mesh.device_type for s in p_specs}
    key = None
    if len(dtypes) == 1 and len(device_types) == 1 and first_local.dtype in dtypes:
        key = (first_local.device, first_local.dtype)
    _compat.bounded_put(_GROUP_KEYS, id(p_specs), (p_specs, key), _GROUP_KEYS_MAX)
    return key


def _make_local_grouping(original):
    def group_tensors_by_device_and_dtype(tensorlistlist, with_indices=False):
        if _STATE.local_grouping and tensorlistlist and tensorlistlist[0]:
            aligned = local_lists_if_aligned(tensorlistlist)
            if aligned is not None:
                p_specs, local = aligned
                key = single_group_key(p_specs, local[0][0])
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


def install_fast_step() -> None:
    """Wrap the ``step`` of :data:`FAST_STEP_CLASSES` and torch.optim's tensor grouping
    (idempotent); see Note [Fast step] and Note [Local grouping]."""
    for cls in FAST_STEP_CLASSES:
        if not getattr(cls.step, _MARK, False):
            cls.step = _wrap_step(cls.step)
    _compat.patch_optimizer_grouping(_make_local_grouping)
