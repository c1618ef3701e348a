"""The routed buffer: its layouts, and the row primitives every exchange and kernel uses.

Shape legend:
    T  tokens routed by this rank
    D  model width
    E  routed experts (global count); e  experts held by this rank (``E`` without EP)
    K  experts per token
    R  rows of the routed buffer, grouped by local expert, including alignment padding
    N  routed (token, expert) pairs, ``T * K``

Note [Dispatcher steps]: an exchange's dispatch is (1) :func:`sort_by_expert` (group the ``N``
(token, expert) pairs by expert, with alignment padding), (2) :func:`permute_tokens` (copy
tokens into the routed buffer), (3) optionally :func:`scores_in_rows` (each row's score). Its
combine is :func:`unpermute_and_reduce`, the one shared reduction tail. A communicating
exchange inserts its collectives between the steps (``routed/all_to_all.py``,
``routed/all_gather.py``). A layout is one of four named variants (:class:`SortedPairs`,
:class:`PaddedPairs`, :class:`PairSubset`, :class:`InOrder`), and every function here takes
each one explicitly.

Note [Deterministic combine]: outside a double backward, no step accumulates with atomics or
``index_add``. Forward gathers rows by index. The combine sums each token's ``K`` rows (the
experts applied the combine weights) in ``k`` order, in one pass with no temporary:
``embedding_bag`` in ``"sum"`` mode, which reads each token's rows by index and accumulates them
in bag order (:func:`sum_rows`; never the ``(T * K, D)`` gathered rows). The backward of the
token gather adds the ``K`` row gradients of each token in ``k`` order the same way; the
backward of the combine writes each row's gradient to its unique routed row (``index_copy``, or
one gather by the inverse permutation when there is no padding; :func:`combine_row_grads`).
Results are the same bits run to run on CPU (tested) and on one CUDA GPU
(``tests/test_cuda.py``, run on an H200 in float32 and bf16; CI has no GPU). Every path (plain,
default, expert-parallel) calls these helpers; the plain path and the default path give the
same output bits.
"""

# ruff: noqa: N803, N806, N812, N815

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F

from dtensor_moe import _compat

__all__ = [
    "Capacity",
    "DeviceCounts",
    "ExpertLayout",
    "InOrder",
    "PaddedPairs",
    "PairSubset",
    "Rows",
    "SortedPairs",
    "in_order",
    "pack_rows",
    "permute_tokens",
    "scores_in_rows",
    "sort_by_expert",
    "subset_layout",
    "unpermute_and_reduce",
    "unpermute_rows",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rows:
    """A routed buffer of ``num_rows`` rows grouped by local expert, ``counts_e`` rows each
    (int64, padding included): what every layout says. The variants below say where the rows
    come from; each function that reads a layout takes each variant explicitly."""

    counts_e: torch.Tensor
    num_rows: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SortedPairs(Rows):
    """The ``T * K`` (token, expert) pairs gathered from their tokens, one row each, in expert
    order, no padding: row ``n`` is sorted pair ``n``.

    Attributes:
        token_N: source token of each sorted pair.
        order_N: flat ``t * K + k`` index of each sorted pair.
        row_TK: the row of pair ``(t, k)``: the inverse of ``order_N``.
    """

    token_N: torch.Tensor
    order_N: torch.Tensor
    row_TK: torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedPairs(SortedPairs):
    """:class:`SortedPairs` in a buffer with alignment padding or dropped pairs.

    Attributes:
        row_N: the buffer row of each sorted pair.
        void_row: some pairs may be dropped for capacity (Note [Expert capacity] in
            ``capacity.py``): their ``row_N``/``row_TK`` is ``num_rows``, one past the buffer,
            a row that reads as zeros and takes no gradient (Note [The void row]).
    """

    row_N: torch.Tensor
    void_row: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class PairSubset(Rows):
    """Sorted pairs ``[start, stop)`` as a buffer of their own, no padding
    (:func:`subset_layout`): a token may have any number of its pairs here.

    Attributes:
        token_N, order_N: as for :class:`SortedPairs`, of the held pairs.
        rows: the rows of the held pairs in token order (each token's in ``k`` order).
        bag_offsets: where token ``t``'s rows start in ``rows``.
    """

    token_N: torch.Tensor
    order_N: torch.Tensor
    rows: torch.Tensor
    bag_offsets: torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class InOrder(Rows):
    """Rows already in buffer order (gathered by the caller, as an exchange's received rows):
    :func:`permute_tokens` and :func:`scores_in_rows` take them as they are."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceCounts(InOrder):
    """:class:`InOrder` rows of a fixed buffer, whose counts stay on the device: the plan never
    reads them on the host. The counts may sum to fewer than ``num_rows``: the experts compute
    the rows up to their sum, and the rows past it are the exchange's to mask (Note [Rows past
    the last offset] in ``fixed.py``)."""


ExpertLayout: TypeAlias = SortedPairs | PaddedPairs | PairSubset | InOrder


@dataclass(frozen=True, kw_only=True, slots=True)
class Capacity:
    """The capacity of one forward, handed to the exchange with the routing (Note [Expert
    capacity] in ``dtensor_moe/moe/capacity.py``).

    Attributes:
        per_expert: ``C``, the most pairs an expert takes.
        padded: every expert's row group is exactly ``C`` rows (``pad_to_capacity``).
    """

    per_expert: int
    padded: bool


def _padding_shift(counts_E: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Row shift of each expert's group after padding, and the padded counts (host ints)."""
    counts = counts_E.tolist()
    padded = [-(-c // pad_multiple) * pad_multiple for c in counts]
    shift, start, padded_start = [], 0, 0
    for c, p in zip(counts, padded):
        shift.append(padded_start - start)
        start, padded_start = start + c, padded_start + p
    return torch.tensor(shift, dtype=torch.int64, device=counts_E.device), padded


def sort_by_expert(
    topk_ids_TK: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    pad_multiple: int = 1,
    capacity: Capacity | None = None,
    elsewhere: bool = False,
) -> SortedPairs | PaddedPairs:
    """Group the ``T * K`` (token, expert) pairs by expert, stably (token order within a group).

    With ``pad_multiple > 1`` each group starts at a multiple of ``pad_multiple`` rows; that
    step reads ``counts_E`` on the host (one device sync).

    With a ``capacity`` (Note [Expert capacity] in ``capacity.py``), ids ``>= counts_E.numel()``
    mark dropped pairs and ``counts_E`` counts the kept ones; see :func:`_capacity_rows`.
    ``elsewhere``: such ids may occur without a capacity too (pairs computed on another rank,
    ``all_gather.py``); they take the void row alike.
    """
    T, K = topk_ids_TK.shape
    ids_N = topk_ids_TK.reshape(-1)
    N = ids_N.numel()
    order_N = torch.argsort(ids_N, stable=True)
    token_N = torch.div(order_N, K, rounding_mode="floor")
    rank_N = torch.arange(N, device=ids_N.device)
    if capacity is not None or elsewhere:
        static_C = capacity.per_expert if capacity is not None and capacity.padded else None
        row_N, counts_e, num_rows = _capacity_rows(
            ids_N.index_select(0, order_N), counts_E, static_C, pad_multiple
        )
        sorted_rows_N = row_N
    elif pad_multiple == 1:
        row_N, counts_e, num_rows = None, counts_E, N
        sorted_rows_N = rank_N
    else:
        shift_E, padded = _padding_shift(counts_E, pad_multiple)
        row_N = rank_N + shift_E[ids_N[order_N]]
        counts_e = torch.tensor(padded, dtype=torch.int64, device=counts_E.device)
        sorted_rows_N, num_rows = row_N, sum(padded)
    row_TK = torch.empty_like(order_N).index_put_((order_N,), sorted_rows_N).view(T, K)
    pairs = {"token_N": token_N, "order_N": order_N, "row_TK": row_TK, "counts_e": counts_e,
             "num_rows": num_rows}  # fmt: skip
    if row_N is None:
        return SortedPairs(**pairs)
    return PaddedPairs(**pairs, row_N=row_N, void_row=capacity is not None or elsewhere)


def _capacity_rows(
    sorted_ids_N: torch.Tensor, counts_E: torch.Tensor, static_C: int | None, pad_multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(row_N, counts_e, num_rows)`` of the expert-sorted pairs when some may be dropped.

    The kept pairs come first in expert order (a dropped pair's id is past every expert), and
    a kept pair's row is its group's start plus its place in the group; a dropped pair's row is
    ``num_rows`` (Note [The void row]). ``static_C``: every group is ``C`` rows
    (``pad_to_capacity``), all sizes static. Otherwise the groups hold the kept pairs (padded
    to ``pad_multiple``), and the buffer length is read on the host.
    """
    G = counts_E.numel()
    N, dev = sorted_ids_N.numel(), sorted_ids_N.device
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    if static_C is not None:
        C = static_C
        counts_e = torch.full((G,), C, dtype=torch.int64, device=dev)
        num_rows = G * C
        group_starts_E = torch.arange(G, device=dev) * C
    elif pad_multiple == 1:
        counts_e, num_rows = counts_E, int(counts_E.sum())
        group_starts_E = starts_E
    else:
        shift_E, padded = _padding_shift(counts_E, pad_multiple)
        counts_e = torch.tensor(padded, dtype=torch.int64, device=dev)
        num_rows = sum(padded)
        group_starts_E = starts_E + shift_E
    g_N = sorted_ids_N.clamp(max=G - 1)
    in_group_N = torch.arange(N, device=dev) - starts_E.index_select(0, g_N)
    row_N = group_starts_E.index_select(0, g_N) + in_group_N
    return row_N.masked_fill_(sorted_ids_N >= G, num_rows), counts_e, num_rows


# Note [The void row]
# ~~~~~~~~~~~~~~~~~~~
# A pair dropped for capacity keeps its place in ``row_TK`` but names row ``R``, one past the
# routed buffer. The token gather writes no buffer row for it; the combine reads the expert
# output with a zero row appended (so the pair adds nothing, and its score's gradient, the dot
# product with that row, is zero); the gather's backward reads the buffer gradient with a zero
# row appended (so the token gets no gradient through the pair). One code path for dropped and
# kept pairs, with static shapes.


class PositionalFunction(torch.autograd.Function):
    """Base of the routed path's autograd Functions that define ``setup_context`` (so that
    ``torch.func`` transforms can run them); :meth:`run` applies one with positional arguments.

    torch 2.13's ``Function.apply`` binds the arguments to ``forward``'s signature
    (``inspect.signature(...).bind``, about 13 us a call on CPU) whenever ``setup_context`` is
    defined, before calling the C ``apply``. With positional arguments and no defaults the
    binding returns the arguments unchanged, so outside a ``torch.func`` transform and outside
    ``torch.compile`` :meth:`run` calls the C ``apply`` (the next one in the method order)
    directly; inside either, ``Function.apply`` runs as it is
    (``tests/test_moe_dispatch.py::test_layer_step_binds_no_autograd_function_signature``).
    """

    @classmethod
    def run(cls, *args: Any) -> Any:
        """``cls.apply(*args)``, without the signature binding where it is not needed."""
        if _compat.functorch_active() or torch.compiler.is_compiling():
            return cls.apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)  # type: ignore[misc]


def _with_void_row(t_RD: torch.Tensor) -> torch.Tensor:
    """``t_RD`` with a zero row appended: what row ``R`` reads (Note [The void row])."""
    return torch.cat((t_RD, t_RD.new_zeros(1, t_RD.shape[-1])))


class _PermuteTokens(PositionalFunction):
    """``routed_RD[row_N[n]] = x_TD[token_N[n]]`` (padding rows zero), deterministic backward."""

    @staticmethod
    def forward(
        x_TD: torch.Tensor,
        token_N: torch.Tensor,
        row_N: torch.Tensor | None,
        num_rows: int,
        row_TK: torch.Tensor,
        void_row: bool,
        bag_offsets: torch.Tensor | None,
        extra_N: torch.Tensor | None,
    ) -> torch.Tensor:
        if extra_N is None:
            rows_ND = x_TD.index_select(0, token_N)
        else:  # one more column, in the same buffer (``row_N`` is None)
            rows_ND = x_TD.new_empty(token_N.numel(), x_TD.shape[-1] + 1)
            torch.index_select(x_TD, 0, token_N, out=rows_ND[:, :-1])
            rows_ND[:, -1] = extra_N
        if row_N is None:
            return rows_ND
        # dropped pairs all land on the void row, which is cut off (Note [The void row])
        buffer = x_TD.new_zeros(num_rows + int(void_row), x_TD.shape[-1])
        return buffer.index_copy_(0, row_N, rows_ND)[:num_rows]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x_TD, _, _, _, row_TK, void_row, bag_offsets, extra_N = inputs
        ctx.save_for_backward(row_TK, bag_offsets)
        ctx.void_row, ctx.num_tokens, ctx.extra = void_row, x_TD.shape[0], extra_N is not None

    @staticmethod
    def backward(ctx: Any, grad_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        row_TK, bag_offsets = ctx.saved_tensors
        grad = _with_void_row(grad_RD) if ctx.void_row else grad_RD
        if bag_offsets is None:
            grad_TD = sum_rows(grad, row_TK)
        else:  # some of each token's pairs (a subset_layout)
            grad_TD = _sum_bags(grad, row_TK, bag_offsets, ctx.num_tokens)
        # the extra column is summed along (no copy of a strided view), then cut off
        out = (grad_TD[:, :-1], grad_RD[:, -1]) if ctx.extra else (grad_TD, None)
        return out[0], *(None,) * 6, out[1]


def _sum_bags(
    src_RD: torch.Tensor, rows: torch.Tensor, offsets_T: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``y_TD[t] = sum of src_RD[rows[offsets_T[t]:offsets_T[t + 1]]]``, in order (empty: 0).
    Differentiable when a graph is being built (Note [Double backward])."""
    if torch.is_grad_enabled() and src_RD.requires_grad:
        lengths = torch.diff(offsets_T, append=offsets_T.new_tensor([rows.numel()]))
        token = torch.repeat_interleave(torch.arange(num_tokens, device=rows.device), lengths)
        return src_RD.new_zeros(num_tokens, src_RD.shape[-1]).index_add(0, token, src_RD[rows])
    return F.embedding_bag(rows, src_RD, offsets_T, mode="sum")


def subset_layout(
    token_N: torch.Tensor,
    order_N: torch.Tensor,
    position_TK: torch.Tensor,
    start: int,
    stop: int,
    counts_e: torch.Tensor,
) -> PairSubset:
    """The layout of sorted pairs ``[start, stop)`` as their own buffer, no padding.

    ``token_N``/``order_N``: every pair's token and flat index in sorted order;
    ``position_TK``: each pair's place in that order. The gather's backward sums each token's
    rows in ``k`` order (``bag_offsets``), so a token may have any number of its pairs here.
    """
    T = position_TK.shape[0]
    held_TK = (position_TK >= start) & (position_TK < stop)
    lengths_T = held_TK.sum(1)
    return PairSubset(
        token_N=token_N[start:stop],
        order_N=order_N[start:stop],
        rows=position_TK[held_TK] - start,  # in (t, k) order: grouped by token
        bag_offsets=(torch.cumsum(lengths_T, 0) - lengths_T).view(T),
        counts_e=counts_e,
        num_rows=stop - start,
    )


def in_order(layout: ExpertLayout) -> InOrder:
    """``layout`` for rows that are already in its buffer order (gathered by the caller, as the
    received rows of an exchange): :func:`permute_tokens` and :func:`scores_in_rows` take them
    as they are."""
    return InOrder(counts_e=layout.counts_e, num_rows=layout.num_rows)


def permute_tokens(
    x_TD: torch.Tensor, layout: ExpertLayout, extra_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy tokens into the routed buffer ``(R, D)``; padding rows are zero.

    The backward gathers the ``K`` row gradients of each token and adds them in ``k`` order
    (see Note [Deterministic combine]); padding rows give no gradient. ``extra_N``: one value
    per row, written as a last column (``(R, D + 1)``, one buffer); not for
    :class:`PaddedPairs`. An :class:`InOrder` layout returns ``x_TD`` itself.
    """
    if isinstance(layout, InOrder):
        return x_TD
    if isinstance(layout, PairSubset):
        return _PermuteTokens.run(x_TD, layout.token_N, None, layout.num_rows, layout.rows,
                                    False, layout.bag_offsets, extra_N)  # fmt: skip
    if isinstance(layout, PaddedPairs):
        if extra_N is not None:
            raise ValueError("permute_tokens: extra_N needs a layout without padding rows")
        return _PermuteTokens.run(x_TD, layout.token_N, layout.row_N, layout.num_rows,
                                    layout.row_TK, layout.void_row, None, None)  # fmt: skip
    return _PermuteTokens.run(x_TD, layout.token_N, None, layout.num_rows, layout.row_TK,
                                False, None, extra_N)  # fmt: skip


def scores_in_rows(scores_TK: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The score of each routed-buffer row (0 on padding rows), differentiable. An
    :class:`InOrder` layout takes the scores as they are."""
    if isinstance(layout, InOrder):
        return scores_TK.reshape(-1)
    scores_N = scores_TK.reshape(-1).index_select(0, layout.order_N)
    if not isinstance(layout, PaddedPairs):
        return scores_N
    void = int(layout.void_row)  # Note [The void row]
    rows = scores_N.new_zeros(layout.num_rows + void).index_copy(0, layout.row_N, scores_N)
    return rows[: layout.num_rows]


def pack_rows(
    x_TD: torch.Tensor, scores_TK: torch.Tensor, layout: ExpertLayout, *, scaled: bool
) -> torch.Tensor:
    """The rows of ``layout`` gathered from ``x_TD``, ready to travel: each with its combine
    weight as one more column, ``(R, D + 1)`` (Note [Packed rows] in ``all_to_all.py``), or with
    ``scaled`` multiplied by it, ``(R, D)``."""
    scores_R = scores_in_rows(scores_TK, layout)
    if scaled:
        return permute_tokens(x_TD, layout) * scores_R.unsqueeze(-1)
    if not isinstance(layout, PaddedPairs):  # gathered straight into the packed buffer
        return permute_tokens(x_TD, layout, scores_R)
    # two copies into one buffer: torch 2.13's CPU ``cat`` along the last dimension with a
    # one-column piece takes about 5x as long
    rows_RD = permute_tokens(x_TD, layout)
    packed_RD1 = rows_RD.new_empty(rows_RD.shape[0], rows_RD.shape[1] + 1)
    packed_RD1[:, :-1] = rows_RD
    packed_RD1[:, -1] = scores_R
    return packed_RD1


class _UnpermuteRows(torch.autograd.Function):
    """``out_ND = src_RD[row_N]`` with unique ``row_N``; backward writes each row once
    (:func:`combine_row_grads` with one pair per row: with ``order_R``, the inverse permutation,
    ``row_N[order_R[r]] == r`` and ``R == N``, one gather instead of zero-filling and
    scattering)."""

    @staticmethod
    def forward(
        ctx: Any, src_RD: torch.Tensor, row_N: torch.Tensor, order_R: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(row_N, order_R)
        ctx.num_rows = src_RD.shape[0]
        return src_RD.index_select(0, row_N)

    @staticmethod
    def backward(ctx: Any, grad_ND: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        row_N, order_R = ctx.saved_tensors
        return combine_row_grads(grad_ND, row_N[:, None], ctx.num_rows, order_R), None, None


def unpermute_rows(out_RD: torch.Tensor, layout: SortedPairs) -> torch.Tensor:
    """The rows of a one-pair-per-token ``layout`` (``K == 1``, as the received rows of an
    exchange) back in token order: ``out_MD[m] = out_RD[layout.row_TK[m, 0]]``; the inverse of
    :func:`permute_tokens` on that layout (padding rows dropped)."""
    order = None if isinstance(layout, PaddedPairs) else layout.order_N
    return _UnpermuteRows.apply(out_RD, layout.row_TK.reshape(-1), order)


def sum_rows(src_RD: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """``y_TD[t] = sum_k src_RD[row_TK[t, k]]``, added in ``k`` order in one pass: the gradient
    of every token gather (Note [Deterministic combine]). ``row_TK`` may be a transposed view.
    Differentiable to any order when a graph is being built (Note [Double backward])."""
    if torch.is_grad_enabled() and src_RD.requires_grad:
        return src_RD[row_TK].sum(1)
    return F.embedding_bag(row_TK, src_RD, mode="sum")


def combine_row_grads(
    grad_TD: torch.Tensor, row_TK: torch.Tensor, num_rows: int, order_N: torch.Tensor | None
) -> torch.Tensor:
    """The gradient of :func:`sum_rows` with respect to ``src_RD``: row ``row_TK[t, k]`` gets
    ``grad_TD[t]``; rows no pair names get zero. With ``order_N`` (the rows are a permutation
    of the pairs) one gather, no zero fill."""
    K = row_TK.shape[1]
    if order_N is not None:
        return grad_TD.index_select(0, torch.div(order_N, K, rounding_mode="floor"))
    grad_RD = grad_TD.new_zeros(num_rows, grad_TD.shape[-1])
    for k in range(K):
        grad_RD.index_copy_(0, row_TK[:, k], grad_TD)
    return grad_RD


# Note [Double backward]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A backward with ``create_graph=True`` (a gradient penalty, a Hessian-vector product) runs
# every node's backward with grad mode on, and differentiates what the backwards compute. The
# token gather's backward sums rows with ``embedding_bag`` (:func:`sum_rows`, ``_sum_bags``),
# whose own backward has no derivative (``torch.autograd.functional.hvp`` needs one). When grad
# mode is on and an input requires grad, they compute the same values with differentiable ops
# instead: an indexing summed over ``K``, or an ``index_add`` per token (equal up to float
# rounding). ``combine_row_grads`` is differentiable as it is. So are the other backwards
# (``swiglu_down``'s formula and the exchanges are made of differentiable ops), and
# ``_compat.local_views``' (the parallel layouts' local views of DTensor weights and inputs),
# which wraps gradients with ``DTensor.from_local`` in grad mode. So every path gives exact
# second derivatives, in one process and under the parallel layouts (``tests/test_moe_layer.py``,
# ``tests/test_parallel_styles.py``: against the per-token reference).


class _SumRows(PositionalFunction):
    """``y_TD[t] = sum_k src_RD[row_TK[t, k]]`` in one pass (:func:`sum_rows`); backward gives
    each named row its token's gradient (:func:`combine_row_grads`), other rows zero."""

    @staticmethod
    def forward(src_RD: torch.Tensor, row_TK: torch.Tensor, order_N: torch.Tensor | None):
        return F.embedding_bag(row_TK, src_RD, mode="sum")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        src_RD, row_TK, order_N = inputs
        ctx.save_for_backward(row_TK, order_N)
        ctx.num_rows = src_RD.shape[0]

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        row_TK, order_N = ctx.saved_tensors
        return combine_row_grads(grad_TD, row_TK, ctx.num_rows, order_N), None, None


def unpermute_and_reduce(
    out_RD: torch.Tensor,
    row_TK: torch.Tensor,
    scores_TK: torch.Tensor | None,
    *,
    order_N: torch.Tensor | None = None,
    void_row: bool = False,
) -> torch.Tensor:
    """The combine: ``y_TD[t] = sum_k scores_TK[t, k] * out_RD[row_TK[t, k]]``.

    With ``scores_TK=None`` (the layer's combine: the experts applied the scores) the ``K`` rows
    are summed unweighted. Rows not named by ``row_TK`` (alignment padding) reach neither the
    output nor the gradients. ``order_N``: the inverse of ``row_TK.reshape(-1)`` when that is a
    permutation of the rows of ``out_RD`` (no padding; ``ExpertLayout.order_N``), which makes
    the backward a single gather. ``void_row``: ``row_TK`` may name row ``R``, which reads as
    zeros (pairs dropped for capacity; Note [The void row]).

    One autograd node, in one pass (no ``(T * K, D)`` gather of the rows; Note [Deterministic
    combine]). The result is never a view: FSDP2 warns about a wrapped module (the experts) that
    returns one, since an in-place op on it would skip FSDP's pre-backward hook.
    """
    if void_row:
        out_RD = _with_void_row(out_RD)
        order_N = None
    if scores_TK is not None:  # each named row scaled by its pair's score, then summed
        R = out_RD.shape[0]
        flat = scores_TK.reshape(-1).to(out_RD.dtype)
        scores_R = out_RD.new_zeros(R).index_put((row_TK.reshape(-1),), flat)
        out_RD = out_RD * scores_R.unsqueeze(-1)
    return _SumRows.run(out_RD, row_TK, order_N)


