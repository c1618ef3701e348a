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
calls torch's ``step`` unchanged.

The wrapper sits inside torch's own profiling wrapper (which runs the step hooks) when
``dtensor_moe`` is imported before the first optimizer of a class is created, as usual. If an
optimizer of that class existed before the import, step hooks registered on it run inside the
fast region too; that only matters for hooks that rely on another subclass's
``__torch_function__``.
"""

from __future__ import annotations

import functools
import operator
import weakref

import torch
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat

__all__ = ["FAST_STEP_CLASSES", "fast_step_applies", "install_fast_step"]

FAST_STEP_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_ALLOWED_PARAM_TYPES = frozenset({DTensor, torch.Tensor, torch.nn.Parameter})
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
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
            if not set(map(type, _compat.local_tensors(dtensors))) <= _PLAIN_TYPES:
                return False
    return any_dtensor


def _wrap_step(step):
    @functools.wraps(step)
    def fast_step(self, closure=None):
        if closure is None and not torch.compiler.is_compiling() and fast_step_applies(self):
            with _compat.subclass_torch_function_disabled():
                return step(self)
        return step(self, closure)

    setattr(fast_step, _MARK, True)  # functools.wraps copies it onto torch's profiling wrapper
    return fast_step


def install_fast_step() -> None:
    """Wrap the ``step`` of :data:`FAST_STEP_CLASSES` (idempotent); see Note [Fast step]."""
    for cls in FAST_STEP_CLASSES:
        if not getattr(cls.step, _MARK, False):
            cls.step = _wrap_step(cls.step)
