"""GradScaler support: one skip-or-step decision on every rank, whatever the meshes.

Note [GradScaler across meshes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.amp.GradScaler`` checks grads for inf/nan with
``aten._amp_foreach_non_finite_check_and_unscale_``, once per (device, dtype) group of an
optimizer's grads, and feeds the resulting ``found_inf`` to the optimizer, which skips the step
when it is non-zero; ``update()`` then halves the scale. torch 2.13's DTensor handler for that op
reduces ``found_inf`` over the mesh of the *first* grad only. When grads live on several meshes,
an inf that appears on a rank outside that mesh's group is missed by the others: ranks disagree,
some step and some skip, and the replicas drift apart silently.

Our handler runs the check on every grad's local tensor, then max-reduces ``found_inf`` with
exactly **one all-reduce over the default process group per handler call**, whatever the meshes.
The collective never depends on what a rank holds, so every rank knows it before communicating.
(A choice made from the meshes a rank sees cannot be agreed on without communicating: two
pipeline stages see different meshes, each picked a different sequence of groups, and the ranks
either hung or decided per stage.)

The contract, per step:

* **Every rank of the default group calls** ``scaler.unscale_(opt)`` **or** ``scaler.step(opt)``
  **for the same optimizers, in the same order** (``step`` runs the check itself unless
  ``unscale_`` ran first). SPMD training (FSDP2, TP, EP: every rank builds the same optimizer)
  and pipeline schedules with one optimizer and one GradScaler per rank, every rank stepping
  once per step, do this.
* **On every rank, each such optimizer has grads that are DTensors, in the same dtypes.**
  torch calls the check once per (device, dtype) group and DTensor sees only groups holding a
  DTensor, so the number of all-reduces per ``unscale_`` is the number of dtypes among a rank's
  DTensor grads (usually one). Plain-tensor grads may sit beside DTensor grads of their dtype.
  The order of the dtypes does not matter: every all-reduce reduces the same ``found_inf`` (one
  per device), so after the last one every rank holds the maximum over all ranks.

So an inf anywhere makes every rank of the default group skip the step and halve its scale.

Not supported by ``torch.amp.GradScaler`` (these break the contract): a rank whose optimizer
has no DTensor grad in a step (for example a pipeline stage of plain tensors, or one whose grads
are all ``None``), a rank that skips ``unscale_``/``step``, and dtype sets that differ between
ranks. No rank can see that before communicating: a rank of plain grads never reaches the
handler, and the others wait for it in the all-reduce. Use :class:`GradScaler` (below) there.

What can be caught cheaply is caught: each all-reduce carries this rank's ``unscale_`` count and
the index of the dtype group within it, as ``(n, -n)`` pairs reduced with max, so every rank
learns the largest and the smallest count from the same all-reduce. When they differ, every rank
that took part raises the same ``ValueError`` instead of drifting apart. This works when the
mismatched all-reduces meet each other; if a rank first waits in another collective (a pipeline
send, an FSDP all-gather), the job hangs until the process group's timeout. The counts belong to
the default group: a new default group starts them at 0. Reading them back is free on CPU; on an
accelerator the check is skipped, to keep the step free of host syncs (the all-reduce is the
same).

Nothing here is cached: the handler keeps no mesh, group or tensor alive (the counters keep
weak references to the default group and to the current ``found_inf``).

The handler is installed by ``import dtensor_moe`` (see ``register_strategies``).

Note [One agreement per unscale]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`GradScaler` (``dtensor_moe.optim.GradScaler``) is ``torch.amp.GradScaler`` with the
agreement moved from the op to the scaler: its inf check of an optimizer's grads (torch's
``_unscale_grads_``, which ``unscale_`` and ``step`` both run, once per optimizer and step) runs
every (device, dtype) check locally, the handler above skipping its all-reduce, then max-reduces
``found_inf`` once over the default group, with the same sequence counters, and writes the result
into every per-device ``found_inf``. The number of all-reduces is one per ``unscale_`` on every
rank whatever its grads are (DTensors, plain tensors, several dtypes), so pipeline stages of plain
params and stages of DTensor params agree. A rank whose optimizer has no grad at all (torch's
``GradScaler`` would fail there with "No inf checks were recorded") reports it through the same
all-reduce, and every rank raises ``ValueError`` (read back on CPU only, like the counters).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat

__all__ = ["GradScaler", "found_inf_handler", "register_found_inf_handler"]

_OP = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


@dataclass(slots=True)
class _Sequence:
    """Where this rank is in the sequence of inf-check all-reduces (Note [GradScaler across
    meshes]): ``unscale`` counts the ``found_inf`` tensors seen (one per ``unscale_`` and device),
    ``group`` the checks since the current one appeared. Weak references only."""

    world: weakref.ref | None = None
    found_inf: weakref.ref | None = None
    unscale: int = 0
    group: int = 0

    def advance(self, found_inf: torch.Tensor, world: dist.ProcessGroup) -> tuple[int, int]:
        if self.world is None or self.world() is not world:
            self.world, self.found_inf, self.unscale, self.group = weakref.ref(world), None, 0, 0
        if self.found_inf is None or self.found_inf() is not found_inf:
            self.found_inf, self.unscale, self.group = weakref.ref(found_inf), self.unscale + 1, 0
        self.group += 1
        return self.unscale, self.group


_SEQUENCE = _Sequence()

# ``local_only``: set by GradScaler around its inf checks, so that the handler runs them without
# its all-reduce (Note [One agreement per unscale]); per thread, unset everywhere else.
_AGREEING = threading.local()


def _reduce_found_inf(found_inf: torch.Tensor) -> None:
    """Max-reduce ``found_inf`` in place over the default group, with the sequence check."""
    world = dist.group.WORLD
    unscale, group = _SEQUENCE.advance(found_inf, world)
    counts = torch.tensor([unscale, -unscale, group, -group], dtype=torch.float64)
    payload = torch.cat([found_inf.detach().reshape(1).double(), counts.to(found_inf.device)])
    dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=world)
    found_inf.copy_(payload[0])
    if payload.device.type == "cpu":
        _check_sequence(payload.tolist()[1:], unscale, group)


def _check_sequence(reduced: list[float], unscale: int, group: int) -> None:
    most_u, least_u, most_g, least_g = reduced[0], -reduced[1], reduced[2], -reduced[3]
    if most_u == least_u and most_g == least_g:
        return
    raise ValueError(
        "GradScaler: the ranks of the default process group are out of step in the inf check: "
        f"this rank is at unscale_ call {unscale}, dtype group {group}; across the ranks the "
        f"unscale_ call ranges over {least_u:.0f}..{most_u:.0f} and the dtype group over "
        f"{least_g:.0f}..{most_g:.0f}. Every rank must call scaler.unscale_/step for the same "
        "optimizers each step, each with DTensor grads in the same dtypes (see Note [GradScaler "
        "across meshes] in dtensor_moe/optim/scaler.py)"
    )


def found_inf_handler(op, args: tuple, kwargs: dict) -> None:
    """DTensor handler for ``_amp_foreach_non_finite_check_and_unscale_`` over mixed meshes.

    Communication: one all-reduce(max) of ``found_inf`` (and four sequence counters) over the
    default process group; none when the default group has one rank. See Note [GradScaler
    across meshes] for what every rank must do.

    Raises:
        TypeError: ``found_inf`` or ``inv_scale`` is a DTensor (before any collective).
        ValueError: the ranks are out of step (see the Note), on every rank of the all-reduce.
    """
    grads, found_inf, inv_scale = args
    if isinstance(found_inf, DTensor) or isinstance(inv_scale, DTensor):
        raise TypeError(
            "GradScaler's found_inf and inv_scale must be plain tensors, got "
            f"{type(found_inf).__name__} and {type(inv_scale).__name__}."
        )
    local_grads = [_compat.local_tensor(g) if isinstance(g, DTensor) else g for g in grads]
    op(local_grads, found_inf, inv_scale, **kwargs)
    if getattr(_AGREEING, "local_only", False):
        return  # GradScaler agrees once per unscale_ (Note [One agreement per unscale])
    if dist.is_initialized() and dist.get_world_size() > 1:
        _reduce_found_inf(found_inf)


def register_found_inf_handler() -> None:
    """Install :func:`found_inf_handler` as DTensor's handler for the inf check (idempotent)."""
    _compat.custom_op_handlers()[_OP] = found_inf_handler


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip-or-step decision every rank of the default process
    group takes part in, whatever its grads are: DTensors on any meshes, plain tensors (a pipeline
    stage without FSDP2 or EP), several dtypes.

    Same arguments and methods as ``torch.amp.GradScaler``. Every rank must call
    ``unscale_(opt)`` or ``step(opt)`` for the same number of optimizers, in the same order, and
    each optimizer must hold at least one grad on every rank. See Note [One agreement per
    unscale].

    Collectives: one all-reduce (max) of ``found_inf`` and five counters over the default group
    per ``unscale_`` (or ``step`` without it), none when the default group has one rank.

    Raises:
        ValueError: on every rank of the all-reduce (read back on CPU), when the ranks are out of
            step or some rank's optimizer holds no grad.

    Example::

        scaler = dtensor_moe.optim.GradScaler("cpu")
        scaler.scale(loss).backward()   # or a schedule's loss_fn returning scaler.scale(loss)
        scaler.step(opt)                # every rank of every stage steps or skips together
        scaler.update()
    """

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's per-(device, dtype) inf check, locally, then one agreement over the ranks."""
        _AGREEING.local_only = True
        try:
            per_device = _compat.grad_scaler_unscale_grads(
                self, optimizer, inv_scale, found_inf, allow_fp16
            )
        finally:
            _AGREEING.local_only = False
        if dist.is_initialized() and dist.get_world_size() > 1:
            _agree(per_device, found_inf)
        return per_device


def _agree(per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor) -> None:
    """Max-reduce this rank's ``found_inf`` over the default group once and write it into every
    per-device ``found_inf``; the counters of Note [GradScaler across meshes] and a no-grad flag
    ride along (Note [One agreement per unscale])."""
    world = dist.group.WORLD
    unscale, group = _SEQUENCE.advance(found_inf, world)
    device = found_inf.device
    mine = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in per_device.values():
        mine = torch.maximum(mine, tensor.detach().reshape(()).to(device, torch.float64))
    empty = 0.0 if per_device else 1.0
    counts = torch.tensor([unscale, -unscale, group, -group, empty], dtype=torch.float64)
    payload = torch.cat([mine.reshape(1), counts.to(device)])
    dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=world)
    for tensor in per_device.values():
        tensor.copy_(payload[0])
    if payload.device.type != "cpu":
        return
    reduced = payload.tolist()
    if reduced[5] > 0:
        raise ValueError(
            "GradScaler: the optimizer holds no grad on "
            f"{'this rank' if empty else 'another rank'}, so that rank has nothing to check "
            "for inf; every rank must step an optimizer with at least one grad (give a stage's "
            "optimizer the params of that stage only, and run its backward before the step)"
        )
    _check_sequence(reduced[1:5], unscale, group)
