"""The fixed-buffer exchange: dropless expert parallelism with no host read, on static buffers.

Shape legend:
    T  tokens routed by this rank; X  rows per token (``K``, times ``replicas`` under expert TP)
    P  ranks of the mesh; e  experts each rank holds; G  destinations ``P * e``
    C  rows per rank pair (the buffer); D  model width
    N  the ``T * X`` pairs this rank routes; M  the ``P * C`` rows of a buffer

Note [Fixed-buffer exchange]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Registered as ``"fixed"``. Every rank sends every rank of its mesh a block of exactly ``C``
rows, ``C = buffer_factor * N / P`` (the balanced share of a rank pair, times the factor)
rounded up to a multiple of 8, where ``N`` is the agreed size: the most pairs a rank of the mesh
routes (Note [The agreed size]). Every size is a Python int on the host, so forward and backward
read nothing on the host, and ``torch.compile`` traces the exchange with the rest of the layer
(``reads_host_sizes`` is ``False``):

1. the ``T * X`` pairs are sorted by destination rank, then local expert, then token; a pair's
   slot is its destination's block start plus its place in the block. The per-expert counts
   travel ahead as a fixed ``P * e`` all-to-all; the rows, each with its combine weight as one
   more column, as one ``(P * C, D + 1)`` all-to-all with equal splits, gathered straight into
   the buffer that travels. Empty slots are zero.
2. the receiver groups its ``P * C`` rows by local expert on the device (an ``argsort`` of a key
   built from the received counts), the empty slots last. The ``torch._grouped_mm`` offsets
   (from the device counts) end at the last real row, so the experts compute the rows that
   arrived, not the buffer. ``torch._grouped_mm`` leaves the output rows past its last offset
   (and, in backward, those input-gradient rows) unwritten; the moves between slot order and
   expert order write zeros there on the device, so no unwritten value travels or reaches a
   gradient (Note [Rows past the last offset]).
3. the outputs return in slot order by the reverse all-to-all, and each token sums its rows.

A pair whose place in its destination's block is ``C`` or more does not fit: it is not sent and
its output is zero (it names the void slot, Note [The void slot]). The exchange records, on the device, the most rows that did not fit per
destination (:attr:`FixedBufferExchange.overflow`, a running maximum, so an activation-
checkpoint recompute does not count twice); nothing is read until the caller asks, once per
step: :func:`exchange_overflowed` (one all-reduce) or :func:`check_exchanges` (raises on every
rank, naming the layer, the rank pair, the rows and the factor that would have held them).
:func:`step_without_overflow` runs a step function again with a grown factor until no rank
overflows, before any optimizer step (Note [Re-running an overflowed step]).

Collectives on the mesh, all with static splits: forward all-to-all x 3 (counts, rows,
outputs), backward x 2. Eager, c10d's ``all_to_all_single`` writes each into its result (with
the void slot's row after it where one is needed); under ``torch.compile``, the functional
collective, which dynamo traces.

Note [The agreed size]
~~~~~~~~~~~~~~~~~~~~~~
An equal-split exchange needs the same ``C`` on every rank, and ranks may route different
numbers of pairs (a sequence that tp does not divide under SP, a ragged last batch). The ranks
agree on ``N``, the most pairs any of them routes, at the layer's first forward (one all-gather
and host read, which every rank makes there). After that no forward runs a collective of its
own: a rank that routes fewer pairs fills less of the same buffer, and one that routes more
than ``N`` sends what fits and records the rest as rows that did not fit, as for skewed routing.
The step's read (:func:`exchange_overflowed`, :func:`check_exchanges`,
:func:`step_without_overflow`, one all-reduce that every rank makes at the same point) raises
``N`` on every rank to the most pairs a rank routed in its last forward, so the next step's
buffers hold a batch that grew; :func:`step_without_overflow` runs the step again at the new
size before it grows the factor. ``N`` never shrinks (a smaller batch underfills). A rank
whose batch size alone changes therefore never waits in a collective the others do not reach.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from dtensor_moe.routed.all_to_all import destinations
from dtensor_moe.routed.exchange import (
    Received,
    Routed,
    TokenExchange,
    announce_launch,
    register_exchange,
)
from dtensor_moe.routed.layouts import (
    Capacity,
    DeviceCounts,
    PaddedPairs,
    PairSubset,
    PositionalFunction,
    _with_void_row,
    combine_row_grads,
    pack_rows,
    sum_rows,
    unpermute_and_reduce,
)

__all__ = [
    "FixedBufferExchange",
    "check_exchanges",
    "exchange_overflowed",
    "needed_buffer_factor",
    "reset_overflow",
    "set_buffer_factor",
    "step_without_overflow",
]

_ALIGN = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@register_exchange
class FixedBufferExchange(TokenExchange):
    """Expert-parallel dispatch and combine on fixed buffers; see Note [Fixed-buffer exchange].

    Keyword Args:
        buffer_factor: ``C`` over the balanced share of a rank pair (default 1.25); ``>= 1``.
        Every other argument is :class:`~dtensor_moe.routed.TokenExchange`'s.
    """

    name = "fixed"
    hands_over_launches = True
    static_capacity = False
    features = frozenset({"expert_tp", "score_before_experts"})

    def __init__(self, *, buffer_factor: float = 1.25, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.mesh is None:
            raise ValueError(
                "the 'fixed' exchange needs a mesh of the ranks that exchange rows; use "
                "exchange='local' when every expert is on this rank"
            )
        self.buffer_factor = buffer_factor
        # Note [Fixed-buffer exchange]: the most rows that did not fit, per destination rank
        self.overflow: torch.Tensor | None = None
        self.last_rows_per_pair = 0  # C of the last forward, for the strict policy's message
        self.last_num_pairs = 0  # the pairs this rank routed in the last forward (T * X)
        # N of Note [The agreed size], as text (Note [The factor as text]); None before the
        # first forward
        self._pairs_text: str | None = None
        self.agreed_before: int | None = None  # N before the last step's read raised it
        self._last_sent_P: torch.Tensor | None = None  # rows sent per destination, last forward
        # the largest balanced share's multiple that one destination asked for (running max)
        self.demand: torch.Tensor | None = None
        self._group = self.mesh.get_group()  # traced as a constant (a mesh's submesh is not)

    # Note [The factor as text]: the factor is kept as its ``repr``, a string, and read back
    # with ``float`` where ``C`` is computed. torch.compile specializes on a string (a guard on
    # its value, a recompile when it changes), where a float attribute that changes becomes a
    # symbolic float after the first change, and torch 2.13's dynamo then fails to lift the
    # ``C`` computed from it ("Source of ... CeilToInt(...) is None").
    # ``test_fixed_exchange.py``'s ``test_compiled_training`` grows the factor of a compiled
    # layer, and its ``test_compiled_evaluation_whole`` shows that the same layer with the factor
    # as a float attribute still fails.
    @property
    def buffer_factor(self) -> float:
        """``C`` over the balanced share of a rank pair (Note [Fixed-buffer exchange])."""
        return float(self._factor_text)

    @buffer_factor.setter
    def buffer_factor(self, factor: float) -> None:
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor >= 1.0):
            raise ValueError(
                f"the 'fixed' exchange needs a finite buffer_factor >= 1.0, got {factor!r}"
            )
        self._factor_text = repr(float(factor))

    def rows_per_pair(self, num_pairs: int) -> int:
        """``C`` for ``num_pairs`` routed pairs per rank at this factor (Note [Fixed-buffer
        exchange]); the buffer uses :attr:`agreed_pairs`."""
        share = float(self._factor_text) * num_pairs / self.mesh.size()
        return max(_ALIGN, _round_up(math.ceil(share), _ALIGN))

    @property
    def agreed_pairs(self) -> int | None:
        """``N`` of Note [The agreed size]: the most pairs a rank of the mesh routes, as the
        ranks last agreed; ``None`` before the first forward."""
        return None if self._pairs_text is None else int(self._pairs_text)

    def _agree_pairs(self, most: int) -> None:
        """Raise ``N`` to ``most`` (Note [The agreed size]); every rank makes the same call."""
        if self._pairs_text is None or most > int(self._pairs_text):
            self._pairs_text = str(most)

    def check_routing(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> None:
        """The base class's checks; at the layer's first forward, the agreed size ``N``, the
        most pairs a rank of the mesh routes (Note [The agreed size]): one all-gather and host
        read, on every rank at once (under ``torch.compile``, a graph break on that forward
        only)."""
        super().check_routing(x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
        if self._pairs_text is not None:
            return
        mine = torch.tensor([topk_ids_TK.numel() * self.replicas], device=x_TD.device)
        self._agree_pairs(max(funcol.all_gather_single(mine, 0, self.mesh).tolist()))

    def sort_and_send(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None,
    ) -> Routed:
        P, e = self.mesh.size(), self.experts_per_rank
        G, dev = P * e, topk_ids_TK.device
        ids_TX, scores_TX, counts_X = destinations(
            scores_TK, topk_ids_TK, counts_E, experts_per_rank=e, replicas=self.replicas
        )
        T, X = ids_TX.shape
        if self._pairs_text is None:  # check_routing agrees on N before any forward
            raise RuntimeError("the 'fixed' exchange routed before its ranks agreed on a size")
        N = int(self._pairs_text)  # Note [The agreed size]
        C = self.last_rows_per_pair = self.rows_per_pair(N)
        self.last_num_pairs = T * X
        ids_N = ids_TX.reshape(-1).clamp(max=G)  # dropped for capacity: past every destination
        order_N = torch.argsort(ids_N, stable=True)
        dest_N = torch.div(ids_N.index_select(0, order_N), e, rounding_mode="floor")
        per_rank_P = counts_X.view(P, e).sum(1)
        starts_P = torch.cumsum(per_rank_P, 0) - per_rank_P
        place_N = torch.arange(T * X, device=dev) - starts_P.index_select(0, dest_N.clamp(max=P - 1))
        fits_N = (dest_N < P) & (place_N < C)
        M = P * C
        slot_N = torch.where(fits_N, dest_N * C + place_N, M)  # no fit: the void slot
        row_TX = torch.empty_like(order_N).index_put_((order_N,), slot_N).view(T, X)
        self._record(per_rank_P, C, N)
        token_N = torch.div(order_N, X, rounding_mode="floor")
        if self.score_before_experts:  # the rows scaled, then the void slot (the rare option)
            sent = PaddedPairs(
                token_N=token_N, order_N=order_N, row_N=slot_N, row_TK=row_TX,
                counts_e=per_rank_P.clamp(max=C), num_rows=M, void_row=True,
            )  # fmt: skip
            packed_M1W = _with_void_row(pack_rows(x_TD, scores_TX, sent, scaled=True))
        else:  # each slot's token (T: none) and pair (T * X: none); the void slot holds none
            token_M1 = torch.full((M + 1,), T, device=dev).index_put_((slot_N,), token_N)
            pair_M1 = torch.full((M + 1,), T * X, device=dev).index_put_((slot_N,), order_N)
            token_M1[M:].fill_(T)  # a kernel: an indexed assignment of a number copies it
            pair_M1[M:].fill_(T * X)  # from the host, a sync on CUDA
            void = not torch.compiler.is_compiling()  # Note [The void slot]: compiled, none
            rows = M + int(void)
            packed_M1W = _PackSlots.run(
                x_TD, scores_TX, token_M1[:rows], pair_M1[:rows], row_TX, void
            )
        arrived_Pe = _exchange_slots(counts_X, self._group, False, False).view(P, e)
        rows_MW = _SlotExchange.run(packed_M1W, self._group, packed_M1W.shape[0] > M, False)
        perm_M, counts_e, inv_M, empty_M1 = _group_by_expert(arrived_Pe, C)
        return Routed(
            source=x_TD,
            scores=scores_TX,
            layout=PairSubset(  # no rows: every row goes through the exchange, the own ones too
                token_N=order_N[:0], order_N=order_N[:0], rows=order_N[:0],
                bag_offsets=torch.zeros(T, dtype=torch.int64, device=dev),
                counts_e=torch.zeros(e, dtype=torch.int64, device=dev), num_rows=0,
            ),  # fmt: skip
            row_TK=row_TX,
            order_N=None,
            void_row=True,
            exchange=(rows_MW, perm_M, counts_e, inv_M, empty_M1),
        )

    def receive(self, routed: Routed) -> Received:
        """The received rows and their weights grouped by local expert, empty slots last."""
        rows_MW, perm_M, counts_e, inv_M, empty_M1 = routed.exchange
        layout = DeviceCounts(counts_e=counts_e, num_rows=perm_M.numel())
        split = not self.score_before_experts  # the weights travel as the last column
        rows_MD, scores_M = _Regroup.run(rows_MW, perm_M, inv_M, empty_M1, split)
        return Received(rows=rows_MD, scores=scores_M if split else None, layout=layout)

    def send_back(self, out_RD: torch.Tensor, routed: Routed) -> torch.Tensor:
        """The outputs back in slot order, and on their way to the ranks they came from; they
        arrive with the void slot, a zero row, after them (Note [The void slot])."""
        _, perm_M, _, inv_M, empty_M1 = routed.exchange
        in_slots_MD = _Restore.run(out_RD, perm_M, inv_M, empty_M1)
        void = not torch.compiler.is_compiling()  # Note [The void slot]: compiled, none
        return _SlotExchange.run(in_slots_MD, self._group, False, void)

    def _combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any) -> torch.Tensor:
        if torch.compiler.is_compiling():  # no void row: the pairs that did not fit are masked
            return _SumSlots.run(returning, routed.row_TK)
        # ``returning`` holds the void slot itself: a pair that did not fit reads its zero row
        return unpermute_and_reduce(returning, routed.row_TK, None)

    @property
    def last_fill(self) -> float | None:
        """The share of the ``C`` slots that this rank's fullest destination used in the last
        forward (a host read; ``None`` before any forward); ``1.0``: at the edge, or over it."""
        if self._last_sent_P is None:
            return None
        return float(self._last_sent_P.max()) / self.last_rows_per_pair

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """Never: every size is known from the shapes."""
        return False

    def _record(self, per_rank_P: torch.Tensor, C: int, num_pairs: int) -> None:
        """On the device: the running maxima of the rows that did not fit per destination and
        of the factor the fullest destination needed (over the balanced share of the agreed
        size ``num_pairs``); the rows sent, for :attr:`last_fill`."""
        over_P = (per_rank_P - C).clamp(min=0)
        needed = per_rank_P.max().to(torch.float32) * (self.mesh.size() / max(num_pairs, 1))
        if self.overflow is None or self.overflow.device != over_P.device:
            self.overflow = torch.zeros_like(over_P)
            self.demand = torch.zeros((), dtype=torch.float32, device=over_P.device)
        torch.maximum(self.overflow, over_P, out=self.overflow)
        torch.maximum(self.demand, needed, out=self.demand)
        self._last_sent_P = per_rank_P.clamp(max=C).detach()

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, buffer_factor={self.buffer_factor})"


# Note [The void slot]
# ~~~~~~~~~~~~~~~~~~~~
# A pair that does not fit its destination's block names slot ``M = P * C``, one past the
# buffer: the void slot, a zero row on this rank's side of the exchange. The buffers that this
# rank gathers from or sums over carry it as their last row: the packed rows (``(M + 1, W)``:
# the void slot holds no token, and its row is not sent) and the outputs that come back (the
# exchange writes the ``M`` received rows into an ``(M + 1, D)`` buffer whose last row it
# zeroes). The gradients mirror it: the exchange of the packed rows' gradient returns an
# ``(M + 1, W)`` buffer with a zero last row, and that of the outputs' gradient sends the first
# ``M`` rows of the combine's ``(M + 1, D)`` gradient. So a pair that did not fit gathers a
# zero row and sums zero, forward and backward, and no buffer is copied to append a row.
#
# Under ``torch.compile`` the functional collective returns a buffer of its own, and a void row
# would be a copy of it with ``cat``: the buffers have no void slot there, and the two sums
# that read one mask the pairs that name slot ``M`` instead (``_SumSlots`` for the combine,
# ``_PackSlots``' backward for the rows' gradient): ``embedding_bag`` with weights 1 for the
# pairs that fit and 0 for the others, whose gradient goes to a row past the buffer that is
# cut off. Equal to the eager sums up to float rounding (``test_compiled_training``).


def _exchange_slots(
    rows: torch.Tensor, group: Any, void_in: bool, void_out: bool
) -> torch.Tensor:
    """The equal-split all-to-all of ``rows`` (without its last row, the void slot, if
    ``void_in``); the result with a zero void slot after the received rows if ``void_out``
    (Note [The void slot]). Eager: a c10d collective written straight into the result, handing
    over after the launch (Note [Exchange protocol]: ``hands_over_launches``); under
    ``torch.compile``: a functional collective, which dynamo traces."""
    send = (rows[:-1] if void_in else rows).contiguous()
    if torch.compiler.is_compiling():
        out = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, group))
        return torch.cat((out, out.new_zeros(1, *out.shape[1:]))) if void_out else out
    M = send.shape[0]
    out = send.new_empty(M + int(void_out), *send.shape[1:])
    work = dist.all_to_all_single(out[:M], send, group=group, async_op=True)
    announce_launch()
    work.wait()
    if void_out:
        out[M:].zero_()
    return out


class _SlotExchange(PositionalFunction):
    """:func:`_exchange_slots` forward and backward (the backward is the same exchange of the
    gradient, the void slot on the other side)."""

    @staticmethod
    def forward(rows: torch.Tensor, group: Any, void_in: bool, void_out: bool) -> torch.Tensor:
        return _exchange_slots(rows, group, void_in, void_out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.group, ctx.void_in, ctx.void_out = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _SlotExchange.run(grad, ctx.group, ctx.void_out, ctx.void_in), None, None, None


class _PackSlots(PositionalFunction):
    """The ``(M + 1, D + 1)`` send buffer: slot ``m`` holds token ``token_M1[m]``'s row and
    pair ``pair_M1[m]``'s weight as its last column; empty slots and the void slot zero (Note
    [The void slot]). One gather per column group, into the buffer. Backward: each token sums
    its pairs' rows in ``k`` order (as the all-to-all exchange's gather does, so the bits
    agree), and each pair takes its slot's last column; a pair that did not fit reads the void
    slot's zero row. With ``void`` false (compiled) the buffer has no void row, ``(M, D + 1)``,
    and the backward masks those pairs instead."""

    @staticmethod
    def forward(
        x_TD: torch.Tensor,
        scores_TX: torch.Tensor,
        token_M1: torch.Tensor,
        pair_M1: torch.Tensor,
        row_TX: torch.Tensor,
        void: bool,
    ) -> torch.Tensor:
        x_T1D = torch.cat((x_TD, x_TD.new_zeros(1, x_TD.shape[1])))
        s_N1 = torch.cat((scores_TX.reshape(-1), scores_TX.new_zeros(1)))
        if torch.compiler.is_compiling():  # dynamo takes no strided out=
            return torch.cat((x_T1D.index_select(0, token_M1),
                              s_N1.index_select(0, pair_M1).unsqueeze(1)), dim=1)  # fmt: skip
        packed = x_TD.new_empty(token_M1.numel(), x_TD.shape[1] + 1)
        torch.index_select(x_T1D, 0, token_M1, out=packed[:, :-1])
        torch.index_select(s_N1, 0, pair_M1, out=packed[:, -1])
        return packed

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(inputs[4])
        ctx.scores_shape, ctx.void = inputs[1].shape, inputs[5]

    @staticmethod
    def backward(ctx: Any, grad_M1W: torch.Tensor) -> tuple:
        (row_TX,) = ctx.saved_tensors
        if ctx.void:  # the weight column is summed along (no copy of a strided view), cut off
            grad_TD = sum_rows(grad_M1W, row_TX)[:, :-1]
            grad_TX = grad_M1W[:, -1].index_select(0, row_TX.reshape(-1))
        else:  # no void row (compiled): the pairs that did not fit masked
            fits_TX, last_TX = _fits(row_TX, grad_M1W.shape[0])
            grad_TD = _masked_sum_rows(grad_M1W, last_TX, fits_TX)[:, :-1]
            grad_X = grad_M1W[:, -1].index_select(0, last_TX.reshape(-1))
            grad_TX = torch.where(fits_TX.reshape(-1), grad_X, 0)
        return grad_TD, grad_TX.view(ctx.scores_shape), None, None, None, None


def _fits(row_TX: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which pairs name a slot of a ``rows``-slot buffer with no void row, and their slots with
    the void slot ``rows`` moved onto the last one (masked by the first)."""
    return row_TX < rows, row_TX.clamp(max=rows - 1)


def _masked_sum_rows(src_RD: torch.Tensor, row_TX: torch.Tensor, fits_TX: torch.Tensor):
    """``y[t] = sum_x fits[t, x] * src_RD[row_TX[t, x]]``, added in ``x`` order in one pass
    (``sum_rows`` with weights); differentiable when a graph is being built (Note [Double
    backward] in ``layouts.py``)."""
    weights_TX = fits_TX.to(src_RD.dtype)
    if torch.is_grad_enabled() and src_RD.requires_grad:
        return (src_RD[row_TX] * weights_TX.unsqueeze(-1)).sum(1)
    return F.embedding_bag(row_TX, src_RD, mode="sum", per_sample_weights=weights_TX)


class _SumSlots(PositionalFunction):
    """The compiled combine over a buffer with no void row (Note [The void slot]):
    ``y_TD[t] = sum_x out_MD[row_TX[t, x]]`` over the pairs that fit (``row_TX < M``).
    Backward: each slot a pair names gets its token's gradient, in a buffer one row longer
    whose last row (the void slot's) is cut off."""

    @staticmethod
    def forward(out_MD: torch.Tensor, row_TX: torch.Tensor) -> torch.Tensor:
        fits_TX, last_TX = _fits(row_TX, out_MD.shape[0])
        return _masked_sum_rows(out_MD, last_TX, fits_TX)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(inputs[1])
        ctx.rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple:
        (row_TX,) = ctx.saved_tensors
        return combine_row_grads(grad_TD, row_TX, ctx.rows + 1, None)[: ctx.rows], None


def _group_by_expert(
    arrived_Pe: torch.Tensor, C: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The order that groups the received ``(P, C)`` slots by local expert (source rank, then
    slot, inside a group; the empty slots last), each expert's row count, the inverse order, and
    a ``(P * C, 1)`` mask of the empty slots. All on the device."""
    P, e = arrived_Pe.shape
    dev = arrived_Pe.device
    ends_Pe = torch.cumsum(arrived_Pe, 1).clamp(max=C)  # what fits of each block
    slot_C = torch.arange(C, device=dev)
    expert_PC = torch.searchsorted(ends_Pe, slot_C.expand(P, C).contiguous(), right=True)
    slots_M = torch.arange(P * C, device=dev)
    perm_M = torch.argsort((expert_PC * (P * C)).view(-1) + slots_M)  # empty: expert e, last
    inv_M = torch.empty_like(perm_M).index_put_((perm_M,), slots_M)
    counts_e = torch.diff(ends_Pe, dim=1, prepend=ends_Pe.new_zeros(P, 1)).sum(0)
    empty_M1 = (slot_C >= ends_Pe[:, -1:]).view(P * C, 1)
    return perm_M, counts_e, inv_M, empty_M1


# Note [Rows past the last offset]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The grouped experts get the whole ``P * C`` buffer, real rows first, and offsets that end at
# the last real row: ``torch._grouped_mm`` computes no row past it, and leaves those output
# rows unwritten (whatever the allocator held, NaN included), in forward and in its input
# gradient. The two moves between slot order and expert order therefore write zeros wherever
# an empty slot would take such a row: ``_Restore`` (outputs to slots) in its forward,
# ``_Regroup`` (received slots to expert order) in its backward, with ``masked_fill_`` on the
# gathered rows, which selects and never multiplies. Every op between them is row-wise or reads the row groups
# only, so nothing unwritten reaches a real row, an output or a gradient.
# ``tests/test_fixed_exchange.py::test_grouped_mm_leaves_rows_past_the_last_offset`` shows
# the unwritten rows these guards are for.


class _Regroup(PositionalFunction):
    """``rows_MW.index_select(0, perm_M)``: the received slots in expert order; with ``split``,
    the rows and the weights of the last column apart (the rows a fresh, aligned buffer).
    Backward: the inverse gather, the empty slots zero (Note [Rows past the last offset])."""

    @staticmethod
    def forward(
        rows_MW: torch.Tensor,
        perm_M: torch.Tensor,
        inv_M: torch.Tensor,
        empty_M1: torch.Tensor,
        split: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not split:
            return rows_MW.index_select(0, perm_M), rows_MW.new_empty(0)
        return rows_MW[:, :-1].index_select(0, perm_M), rows_MW[:, -1].index_select(0, perm_M)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        rows_MW, _, inv_M, empty_M1, split = inputs
        ctx.save_for_backward(inv_M, empty_M1)
        ctx.split, ctx.width = split, rows_MW.shape[-1]

    @staticmethod
    def backward(ctx: Any, grad_MD: torch.Tensor, grad_M: torch.Tensor) -> tuple:
        inv_M, empty_M1 = ctx.saved_tensors
        if not ctx.split:
            grad_MW = grad_MD.index_select(0, inv_M)
        elif torch.compiler.is_compiling():  # dynamo takes no strided out=
            grad_MW = torch.cat((grad_MD.index_select(0, inv_M),
                                 grad_M.index_select(0, inv_M).unsqueeze(1)), dim=1)  # fmt: skip
        else:  # both gathers straight into the buffer that travels
            grad_MW = grad_MD.new_empty(grad_MD.shape[0], ctx.width)
            torch.index_select(grad_MD, 0, inv_M, out=grad_MW[:, :-1])
            torch.index_select(grad_M, 0, inv_M, out=grad_MW[:, -1])
        return grad_MW.masked_fill_(empty_M1, 0), *(None,) * 4


class _Restore(PositionalFunction):
    """``out_RD.index_select(0, inv_M)``: the expert outputs in slot order, the empty slots zero
    (Note [Rows past the last offset]). Backward: the gather in expert order; the rows past the
    last offset take the empty slots' gradients, which no kernel reads."""

    @staticmethod
    def forward(
        out_RD: torch.Tensor, perm_M: torch.Tensor, inv_M: torch.Tensor, empty_M1: torch.Tensor
    ) -> torch.Tensor:
        return out_RD.index_select(0, inv_M).masked_fill_(empty_M1, 0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad_MD: torch.Tensor) -> tuple:
        (perm_M,) = ctx.saved_tensors
        return grad_MD.index_select(0, perm_M), None, None, None


def _fixed_exchanges(
    model: nn.Module, *, required: bool = False
) -> list[tuple[str, FixedBufferExchange]]:
    """Every fixed exchange of ``model``, with its module's name; ``required``: at least one."""
    found = []
    for name, module in model.named_modules():
        exchange = getattr(getattr(module, "plan", None), "exchange", None)
        if isinstance(exchange, FixedBufferExchange):
            found.append((name, exchange))
    if required and not found:
        raise ValueError(
            f"{type(model).__name__} holds no 'fixed' exchange; parallelize its experts with "
            "exchange='fixed'"
        )
    return found


def _overflow_table(model: nn.Module) -> tuple[list[tuple[str, FixedBufferExchange]], torch.Tensor]:
    """Every fixed exchange of ``model`` and, per exchange and destination, the most rows that
    did not fit on any rank since the last reset: one all-reduce (MAX) over the default group,
    so every rank sees the same table. The same all-reduce raises each exchange's agreed size
    to the most pairs a rank routed in its last forward (Note [The agreed size]); each
    exchange's ``agreed_before`` is what it was before."""
    found = _fixed_exchanges(model, required=True)
    dev = next((ex.overflow.device for _, ex in found if ex.overflow is not None), "cpu")
    table = torch.stack([
        torch.cat((
            torch.zeros(ex.mesh.size(), dtype=torch.int64, device=dev) if ex.overflow is None
            else ex.overflow.detach().to(dev),
            torch.tensor([ex.last_num_pairs], dtype=torch.int64, device=dev),
        )) for _, ex in found
    ])  # fmt: skip
    if dist.is_initialized():
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    table = table.cpu()
    for (_, exchange), most in zip(found, table[:, -1].tolist(), strict=True):
        exchange.agreed_before = exchange.agreed_pairs
        if exchange.agreed_pairs is not None:  # not before a first forward
            exchange._agree_pairs(most)
    return found, table[:, :-1]


def exchange_overflowed(model: nn.Module) -> bool:
    """Whether any fixed exchange of ``model`` had rows that did not fit, on any rank, since the
    counters were last reset (:func:`reset_overflow`); one host read and one all-reduce."""
    _, table = _overflow_table(model)
    return bool(table.max() > 0)


def reset_overflow(model: nn.Module) -> None:
    """Zero the overflow and demand records of every fixed exchange of ``model`` (no
    collective)."""
    for _, exchange in _fixed_exchanges(model):
        if exchange.overflow is not None:
            exchange.overflow.zero_()
            exchange.demand.zero_()


def needed_buffer_factor(model: nn.Module) -> float:
    """The smallest ``buffer_factor`` that would have held every rank pair of every fixed
    exchange of ``model`` since the records were last reset (:func:`reset_overflow`): the most
    rows one rank sent one destination, over the balanced share ``tokens x top_k / ranks``
    (before ``C``'s rounding up to 8, which holds a little more). One host read and one
    all-reduce (MAX), so every rank gets the same value; ``0.0`` before any forward. Read it
    over a few steps to choose the factor; it is highest early in training, when the routing
    is most skewed."""
    found = _fixed_exchanges(model, required=True)
    dev = next((ex.demand.device for _, ex in found if ex.demand is not None), "cpu")
    most = torch.stack([ex.demand.detach().to(dev) if ex.demand is not None
                        else torch.zeros((), device=dev) for _, ex in found]).max()  # fmt: skip
    if dist.is_initialized():
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return float(most)


def check_exchanges(model: nn.Module) -> None:
    """The strict policy: raise the same ``RuntimeError`` on every rank when rows did not fit,
    naming the layer, the rank pair, the rows and the factor that would have held them; then
    reset the records. One host read and one all-reduce; call it once per step, after the
    backward (where the loss is read) and before the optimizer steps."""
    found, table = _overflow_table(model)
    reset_overflow(model)
    if table.max() <= 0:
        return
    i, q = divmod(int(table.argmax()), table.shape[1])
    name, exchange = found[i]
    rows = int(table[i, q])
    C = exchange.last_rows_per_pair
    before, now = exchange.agreed_before, exchange.agreed_pairs
    if before is not None and now is not None and now > before:  # Note [The agreed size]
        raise RuntimeError(
            f"the fixed exchange of {name or '<root>'!r} over {exchange.mesh} had {rows} rows "
            f"that did not fit its buffer of {C} rows towards rank {exchange.ranks[q]}: a rank "
            f"routed {now} pairs, more than the {before} the buffers were sized for (a batch "
            "that grew). The buffers hold it from the next step on; run this step again, or "
            "run steps with step_without_overflow, which does"
        )
    # the rows the pair needed over the balanced share (C itself was rounded up from its own)
    needed = (C + rows) * exchange.mesh.size() / max(before or 1, 1)
    raise RuntimeError(
        f"the fixed exchange of {name or '<root>'!r} over {exchange.mesh} had {rows} rows that "
        f"did not fit its buffer of {C} rows towards rank {exchange.ranks[q]} (buffer_factor="
        f"{exchange.buffer_factor}); a buffer_factor of {math.ceil(needed * 100) / 100:.2f} "
        "would have held them. "
        "Raise it (set_buffer_factor), or run the step with step_without_overflow, which "
        "grows it and runs the step again"
    )


def set_buffer_factor(model: nn.Module, factor: float) -> None:
    """Set ``buffer_factor`` on every fixed exchange of ``model`` (the same on every rank)."""
    for _, exchange in _fixed_exchanges(model):
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"buffer_factor must be a finite number >= 1.0, got {factor!r}")
        exchange.buffer_factor = factor


# Note [Re-running an overflowed step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``step_without_overflow(model, step)`` runs ``step()`` (forward and backward, no optimizer
# step), reads the overflow records once (one all-reduce, so every rank decides alike) and, if
# any rank overflowed, zeroes the grads, puts the routers' counters back as they were before
# the step, grows ``buffer_factor`` on every rank and runs the same ``step()`` again, up to
# ``max_tries`` times. No parameter, optimizer state or counter keeps anything of an overflowed
# run, and no batch is lost. A grown factor changes the buffers' shapes, so a compiled model
# compiles once more for it. With a GradScaler, call ``scaler.scale(loss).backward()`` inside
# ``step`` and ``scaler.step``/``scaler.update`` after: an overflowed run never reaches them.
# Under a pipeline schedule, ``step`` is the schedule's ``step`` call.


def step_without_overflow(
    model: nn.Module, step: Callable[[], Any], *, grow: float = 1.5, max_tries: int = 4
) -> Any:
    """Run ``step()`` until no fixed exchange of ``model`` overflows on any rank (Note
    [Re-running an overflowed step]); returns what the last run returned."""
    if not (grow > 1.0 and max_tries >= 1):
        raise ValueError(f"step_without_overflow needs grow > 1 and max_tries >= 1, got {grow}, "
                         f"{max_tries}")  # fmt: skip
    counters = [(b, b.detach().clone()) for m in model.modules() for n, b in
                m.named_buffers(recurse=False) if n in ("tokens_per_expert", "dropped_per_expert")]
    reset_overflow(model)
    for attempt in range(max_tries):
        out = step()
        if not exchange_overflowed(model):
            return out
        reset_overflow(model)
        for p in model.parameters():
            p.grad = None
        for buffer, before in counters:
            buffer.copy_(before)
        found = _fixed_exchanges(model)
        if any(ex.agreed_pairs != ex.agreed_before for _, ex in found):
            continue  # a batch that grew: the buffers follow it first (Note [The agreed size])
        if attempt + 1 < max_tries:
            factor = max(ex.buffer_factor for _, ex in found) * grow
            set_buffer_factor(model, factor)
    raise RuntimeError(
        f"step_without_overflow: rows still did not fit after {max_tries} runs (buffer_factor "
        f"{max(ex.buffer_factor for _, ex in _fixed_exchanges(model))}); raise max_tries or grow"
    )
