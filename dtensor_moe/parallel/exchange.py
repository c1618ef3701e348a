"""Row exchanges between ranks as autograd op pairs: a start that launches an all-to-all, and a
wait that completes it.

Shape legend:
    N  rows on the sending side: ``n_send`` to other ranks, then ``n_local`` that stay, then
       ``n_tail`` rows that are zero (pairs dropped for capacity)
    M  rows received from the other ranks, ``n_recv``

Note [Exchanges as autograd pairs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Expert-parallel dispatch moves rows out (*scatter*: ``N -> M``) and combine moves the expert
outputs back (*gather*: ``M -> N``). Each move is two autograd ops: ``*_start`` launches
``torch.distributed.all_to_all_single(async_op=True)`` and returns the buffer it fills;
``*_wait`` waits for it. Whatever the caller puts between the two runs while the rows travel.

The backward of a scatter is a gather of the gradients with the same splits, and the other way
round, and it is written with the same ops: the backward of ``*_wait`` *starts* the reverse
exchange and the backward of ``*_start`` *waits* for it. Autograd runs ready nodes latest-
created first, so the work placed between a start and its wait in the forward runs between the
reverse exchange's start and wait in the backward: the overlap in both directions comes from
the order of the calls. Because the backward is made of the same differentiable ops, the
exchanges can be differentiated to any order (``create_graph=True``).

The local rows of a scatter (``n_local``, this rank's own share) are returned as a view, not
sent; a gather writes the local rows after the received ones and zeros the tail. So a rank's
own rows never go through the collective, and the sending side's buffer of ``N`` rows, in the
order the caller sorted them, is what combine reads.

Every rank issues the same exchanges in the same order, with sizes agreed beforehand (the
dispatcher's count exchange), so the collectives match. ``CommDebugMode`` counts each one.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Exchange", "gather_start", "gather_wait", "scatter_start", "scatter_wait"]

# Called with no argument right after every exchange is launched, forward or backward (a
# scheduler that interleaves two micro-batches switches to the other one there); ``None``: no
# call. Set it through ``set_after_launch``.
_after_launch: Any = None


def set_after_launch(hook: Any) -> Any:
    """Install ``hook`` (a callable taking no argument, or ``None``) to run right after every
    exchange's all-to-all is launched; returns the previous one."""
    global _after_launch
    previous, _after_launch = _after_launch, hook
    return previous


class Exchange:
    """Splits of one exchange, from the scattering side, and the state of its collective.

    ``send[q]``/``recv[q]``: rows sent to and received from rank ``q`` of ``group`` (0 for
    this rank: its rows are the ``n_local`` ones). One ``Exchange`` serves one forward move and
    the reverse move of its backward; it holds no tensor once both are done.
    """

    __slots__ = ("group", "send", "recv", "n_send", "n_recv", "n_local", "n_tail", "work",
                 "pending", "mirror")  # fmt: skip

    def __init__(
        self, group: Any, send: list[int], recv: list[int], n_local: int = 0, n_tail: int = 0
    ) -> None:
        self.group, self.send, self.recv = group, send, recv
        self.n_send, self.n_recv = sum(send), sum(recv)
        self.n_local, self.n_tail = n_local, n_tail
        self.work: Any = None
        self.pending: torch.Tensor | None = None
        self.mirror: Exchange | None = None

    def mirrored(self) -> Exchange:
        return Exchange(self.group, self.send, self.recv, self.n_local, self.n_tail)

    def wait(self) -> None:
        for work in self.work:
            work.wait()
        self.work = None


def _launch(ex: Exchange, outs: list, ins: list, out_splits, in_splits) -> None:
    ex.work = [
        dist.all_to_all_single(o, i.contiguous(), out_splits, in_splits, group=ex.group,
                               async_op=True)
        for o, i in zip(outs, ins)
    ]  # fmt: skip
    if _after_launch is not None:
        _after_launch()


def _started(ex: Exchange) -> tuple[tuple[torch.Tensor, ...], Exchange]:
    """The buffers and the exchange that the backward of ``ex``'s wait started (the reverse
    move), handed to the backward of its start, which waits for them; ``ex`` lets go of them."""
    pending, mirror = ex.pending, ex.mirror
    ex.pending = ex.mirror = None
    return pending, mirror


class _ScatterStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        recv = [r.new_empty((ex.n_recv, *r.shape[1:])) for r in rows]
        _launch(ex, recv, [r[: ex.n_send] for r in rows], ex.recv, ex.send)
        ctx.ex = ex
        return (*recv, *(r[ex.n_send : ex.n_send + ex.n_local] for r in rows))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        pending, mirror = _started(ctx.ex)  # by _ScatterWait.backward
        return None, *_GatherWait.apply(mirror, *pending, *grads[len(pending) :])


class _ScatterWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, *recv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ex.wait()
        ctx.ex = ex
        return recv

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ex = ctx.ex
        ex.mirror = ex.mirrored()
        ex.pending = _GatherStart.apply(ex.mirror, *grads)
        return None, *grads  # stand-ins: _ScatterStart.backward reads ex.pending


class _GatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = ex.n_send + ex.n_local + ex.n_tail
        full = [o.new_empty((n, *o.shape[1:])) for o in outs]
        _launch(ex, [f[: ex.n_send] for f in full], list(outs), ex.send, ex.recv)
        ctx.ex = ex
        return tuple(full)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        pending, mirror = _started(ctx.ex)  # by _GatherWait.backward
        return None, *_ScatterWait.apply(mirror, *pending)


class _GatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: Exchange, *full_and_local: torch.Tensor) -> tuple:
        ex.wait()
        n = len(full_and_local) // 2
        end = ex.n_send + ex.n_local
        for full, local in zip(full_and_local[:n], full_and_local[n:]):
            full[ex.n_send : end].copy_(local)
            full[end:].zero_()
        ctx.mark_dirty(*full_and_local[:n])
        ctx.ex = ex
        return full_and_local[:n]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ex = ctx.ex
        ex.mirror = ex.mirrored()
        out = _ScatterStart.apply(ex.mirror, *grads)
        ex.pending = out[: len(grads)]
        return None, *grads, *out[len(grads) :]  # grads: stand-ins for _GatherStart.backward


def scatter_start(ex: Exchange, *rows_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Send ``rows_N[:n_send]`` of each tensor (one collective each, the same splits);
    returns the receive buffers (in flight: pass them to :func:`scatter_wait` before reading
    them), then the local rows of each (views). One autograd node for all of them, so that
    every rank runs the reverse exchanges in the same order."""
    return _ScatterStart.apply(ex, *rows_N)


def scatter_wait(ex: Exchange, *recv_M: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The received rows of :func:`scatter_start`, once they have arrived."""
    return _ScatterWait.apply(ex, *recv_M)


def gather_start(ex: Exchange, *out_M: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Send each ``out_M`` back to the ranks its rows came from; returns the ``N``-row buffers
    (in flight: pass them to :func:`gather_wait`)."""
    return _GatherStart.apply(ex, *out_M)


def gather_wait(ex: Exchange, *full_and_local: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The ``N`` rows of :func:`gather_start`: received rows, then the local rows, then zeros;
    pass the in-flight buffers, then one local tensor per buffer."""
    return _GatherWait.apply(ex, *full_and_local)
