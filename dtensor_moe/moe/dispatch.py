"""Token dispatch and combine around the routed experts.

Shape legend:
    T  tokens routed by this rank
    D  model width
    E  routed experts (global count); e  experts held by this rank (``E`` without EP)
    K  experts per token
    R  rows of the routed buffer, grouped by local expert, including alignment padding
    N  routed (token, expert) pairs, ``T * K``

Note [Dispatcher steps]: dispatch is (1) :func:`sort_by_expert` (group the ``N`` (token,
expert) pairs by expert, with alignment padding), (2) :func:`permute_tokens` (copy tokens into
the routed buffer), (3) optionally :func:`scores_in_rows` (scale rows by their score). Combine is
:func:`unpermute_and_reduce`, the one shared scoring + reduction tail. The base class issues no
communication. An expert-parallel subclass overrides ``dispatch``/``combine`` and inserts its
exchange between the steps: sort by global expert without padding, permute, scale, all-to-all
(counts, then tokens), then sort the received rows by *local* expert with padding by calling
:func:`sort_by_expert` again on ``(rows, 1)`` local ids, and the reverse in combine. Everything
one forward needs goes into the frozen values the stages return (:class:`Routed`,
:class:`Received`), never onto ``self``.

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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dtensor_moe import _compat
from dtensor_moe.moe.capacity import Capacity

__all__ = [
    "ExpertLayout",
    "Received",
    "Routed",
    "TokenDispatcher",
    "in_order",
    "permute_tokens",
    "scores_in_rows",
    "sort_by_expert",
    "subset_layout",
    "unpermute_and_reduce",
    "unpermute_rows",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertLayout:
    """Where each (token, expert) pair lives in the routed buffer.

    Attributes:
        token_N: source token of each pair, in expert-sorted order.
        order_N: flat ``t * K + k`` index of each pair, in expert-sorted order.
        row_N: routed-buffer row of each sorted pair, or ``None`` when there is no padding
            (then row ``n`` is pair ``n``).
        row_TK: routed-buffer row of pair ``(t, k)``; the inverse of ``order_N``/``row_N``.
        counts_e: rows per local expert, padding included (int64).
        num_rows: ``R``, the routed-buffer length.
        void_row: some pairs may be dropped for capacity (Note [Expert capacity] in
            ``capacity.py``): their ``row_N``/``row_TK`` is ``R``, one past the buffer, a row
            that reads as zeros and takes no gradient (Note [The void row]).
        bag_offsets: set when the layout holds only some of each token's pairs (a
            :func:`subset_layout`): then ``row_TK`` is 1-D, the rows of the pairs it holds in
            token order, and token ``t``'s rows start at ``bag_offsets[t]``.

    ``token_N`` and ``order_N`` are ``None`` in a layout of rows already in buffer order
    (:func:`in_order`).
    """

    token_N: torch.Tensor | None
    order_N: torch.Tensor | None
    row_N: torch.Tensor | None
    row_TK: torch.Tensor
    counts_e: torch.Tensor
    num_rows: int
    void_row: bool = False
    bag_offsets: torch.Tensor | None = None


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
) -> ExpertLayout:
    """Group the ``T * K`` (token, expert) pairs by expert, stably (token order within a group).

    With ``pad_multiple > 1`` each group starts at a multiple of ``pad_multiple`` rows; that
    step reads ``counts_E`` on the host (one device sync).

    With a ``capacity`` (Note [Expert capacity] in ``capacity.py``), ids ``>= counts_E.numel()``
    mark dropped pairs and ``counts_E`` counts the kept ones; see :func:`_capacity_rows`.
    """
    T, K = topk_ids_TK.shape
    ids_N = topk_ids_TK.reshape(-1)
    N = ids_N.numel()
    order_N = torch.argsort(ids_N, stable=True)
    token_N = torch.div(order_N, K, rounding_mode="floor")
    rank_N = torch.arange(N, device=ids_N.device)
    if capacity is not None:
        row_N, counts_e, num_rows = _capacity_rows(
            ids_N.index_select(0, order_N), counts_E, capacity, pad_multiple
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
    row_flat = torch.empty_like(order_N).index_put_((order_N,), sorted_rows_N)
    return ExpertLayout(
        token_N=token_N,
        order_N=order_N,
        row_N=row_N,
        row_TK=row_flat.view(T, K),
        counts_e=counts_e,
        num_rows=num_rows,
        void_row=capacity is not None,
    )


def _capacity_rows(
    sorted_ids_N: torch.Tensor, counts_E: torch.Tensor, capacity: Capacity, pad_multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(row_N, counts_e, num_rows)`` of the expert-sorted pairs when some may be dropped.

    The kept pairs come first in expert order (a dropped pair's id is past every expert), and
    a kept pair's row is its group's start plus its place in the group; a dropped pair's row is
    ``num_rows`` (Note [The void row]). ``capacity.padded``: every group is ``C`` rows, all
    sizes static. Otherwise the groups hold the kept pairs (padded to ``pad_multiple``), and
    the buffer length is read on the host.
    """
    G = counts_E.numel()
    N, dev = sorted_ids_N.numel(), sorted_ids_N.device
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    if capacity.padded:
        C = capacity.per_expert
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


def _with_void_row(t_RD: torch.Tensor) -> torch.Tensor:
    """``t_RD`` with a zero row appended: what row ``R`` reads (Note [The void row])."""
    return torch.cat((t_RD, t_RD.new_zeros(1, t_RD.shape[-1])))


class _PermuteTokens(_compat.PositionalApply, torch.autograd.Function):
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
) -> ExpertLayout:
    """The layout of sorted pairs ``[start, stop)`` as their own buffer, no padding.

    ``token_N``/``order_N``: every pair's token and flat index in sorted order;
    ``position_TK``: each pair's place in that order. The gather's backward sums each token's
    rows in ``k`` order (``bag_offsets``), so a token may have any number of its pairs here.
    """
    T = position_TK.shape[0]
    held_TK = (position_TK >= start) & (position_TK < stop)
    rows = position_TK[held_TK] - start  # in (t, k) order: grouped by token
    lengths_T = held_TK.sum(1)
    return ExpertLayout(
        token_N=token_N[start:stop],
        order_N=order_N[start:stop],
        row_N=None,
        row_TK=rows,
        counts_e=counts_e,
        num_rows=stop - start,
        bag_offsets=(torch.cumsum(lengths_T, 0) - lengths_T).view(T),
    )


def in_order(layout: ExpertLayout) -> ExpertLayout:
    """``layout`` for rows that are already in its buffer order (gathered by the caller, as the
    received rows of an exchange): :func:`permute_tokens` and :func:`scores_in_rows` take them
    as they are."""
    return dataclasses.replace(layout, token_N=None, order_N=None, row_N=None)


def permute_tokens(
    x_TD: torch.Tensor, layout: ExpertLayout, extra_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy tokens into the routed buffer ``(R, D)``; padding rows are zero.

    The backward gathers the ``K`` row gradients of each token and adds them in ``k`` order
    (see Note [Deterministic combine]); padding rows give no gradient. ``extra_N``: one value
    per row, written as a last column (``(R, D + 1)``, one buffer); only for a layout without
    padding (``row_N`` None). A layout :func:`in_order` returns ``x_TD`` itself.
    """
    if layout.token_N is None:
        return x_TD
    if extra_N is not None and layout.row_N is not None:
        raise ValueError("permute_tokens: extra_N needs a layout without padding rows (row_N None)")
    return _PermuteTokens.apply(
        x_TD, layout.token_N, layout.row_N, layout.num_rows, layout.row_TK, layout.void_row,
        layout.bag_offsets, extra_N,
    )  # fmt: skip


def scores_in_rows(scores_TK: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The score of each routed-buffer row (0 on padding rows), differentiable. A layout
    :func:`in_order` takes the scores as they are."""
    if layout.order_N is None:
        return scores_TK.reshape(-1)
    scores_N = scores_TK.reshape(-1).index_select(0, layout.order_N)
    if layout.row_N is None:
        return scores_N
    void = int(layout.void_row)  # Note [The void row]
    rows = scores_N.new_zeros(layout.num_rows + void).index_copy(0, layout.row_N, scores_N)
    return rows[: layout.num_rows]


class _UnpermuteRows(torch.autograd.Function):
    """``out_ND = src_RD[row_N]`` with unique ``row_N``; backward writes each row once.

    With ``order_R`` (the inverse permutation: ``row_N[order_R[r]] == r``, so ``R == N``) the
    backward is one gather, ``grad_ND[order_R]``, instead of zero-filling and scattering.
    """

    @staticmethod
    def forward(
        ctx: Any, src_RD: torch.Tensor, row_N: torch.Tensor, order_R: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(row_N if order_R is None else order_R)
        ctx.num_rows, ctx.inverse = src_RD.shape[0], order_R is not None
        return src_RD.index_select(0, row_N)

    @staticmethod
    def backward(ctx: Any, grad_ND: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        if ctx.inverse:
            return grad_ND.index_select(0, index), None, None
        grad_RD = grad_ND.new_zeros(ctx.num_rows, grad_ND.shape[-1])
        return grad_RD.index_copy_(0, index, grad_ND), None, None


def unpermute_rows(out_RD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The rows of a one-pair-per-token ``layout`` (``K == 1``, as the received rows of an
    exchange) back in token order: ``out_MD[m] = out_RD[layout.row_TK[m, 0]]``; the inverse of
    :func:`permute_tokens` on that layout (padding rows dropped)."""
    order = layout.order_N if layout.row_N is None else None
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


class _SumRows(_compat.PositionalApply, torch.autograd.Function):
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
    return _SumRows.apply(out_RD, row_TK, order_N)


@dataclass(frozen=True, kw_only=True, slots=True)
class Routed:
    """What :meth:`TokenDispatcher.dispatch` returns: the rows this rank computes itself, and
    what :meth:`~TokenDispatcher.receive` and :meth:`~TokenDispatcher.combine` need.

    Attributes:
        source: ``x_TD``: the local rows are gathered from it.
        scores: each pair's combine weight ``(T, X)`` in ``source``'s dtype (``X = K``, or
            ``K * replicas`` under expert TP by all-to-all), or ``None``.
        layout: the local rows (all of them without an exchange; this rank's own share under
            expert parallelism), for :meth:`GroupedExperts.compute`.
        row_TK: each pair's row among the rows combine sums (the local rows, or under expert
            parallelism every pair's row in the send order).
        order_N: the inverse of ``row_TK`` when it is a permutation, else ``None``.
        void_row: ``row_TK`` may name one row past the end (Note [The void row]).
        exchange: the state of a dispatcher's exchange (``None`` without one).
    """

    source: torch.Tensor
    scores: torch.Tensor | None
    layout: ExpertLayout
    row_TK: torch.Tensor
    order_N: torch.Tensor | None
    void_row: bool = False
    exchange: Any = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Received:
    """The rows other ranks sent here (:meth:`TokenDispatcher.receive`): ``rows``, their
    ``scores`` and the ``layout`` that groups them by local expert, for
    :meth:`GroupedExperts.compute`. ``rows`` is the layout's source: ``(M, D)`` in arrival order
    (scores ``(M,)``), or already in the layout's buffer order, ``(R, D)`` and ``(R,)``, with a
    layout :func:`in_order` (``AllToAllTokenDispatcher`` gathers them so)."""

    rows: torch.Tensor
    scores: torch.Tensor | None
    layout: ExpertLayout


class TokenDispatcher:
    """Local (single-rank) dispatch and combine; the base class of parallel dispatchers.

    Keyword Args:
        num_experts: ``E``, routed experts in the whole layer.
        pad_multiple: align each local expert's row group to this multiple (``1``: no padding).
        score_before_experts: scale routed rows by their score before the experts instead of
            their outputs after.

    The stages, each called once per forward, in this order (``GroupedExperts.forward``)::

        routed = dispatch(x_TD, scores, ids, counts)     # sort; start any exchange
        received = receive(routed)                       # wait for it (None: no exchange)
        returning = send_back(out_of_received, routed)   # start the way back (None: none)
        y_TD = combine(out_of_local_rows, routed, returning)

    A caller may put other work between any two of them. No collective runs here; a parallel
    subclass adds its exchanges in these methods and keeps all per-forward state in the
    returned (frozen) values, never on ``self``.
    """

    def __init__(
        self, *, num_experts: int, pad_multiple: int = 1, score_before_experts: bool = False
    ) -> None:
        if num_experts < 1 or pad_multiple < 1:
            raise ValueError(
                f"TokenDispatcher needs num_experts >= 1 and pad_multiple >= 1, got "
                f"num_experts={num_experts}, pad_multiple={pad_multiple}"
            )
        self.num_experts = num_experts
        self.pad_multiple = pad_multiple
        self.score_before_experts = score_before_experts

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> Routed:
        """Group the (token, expert) pairs by expert (Note [Dispatcher steps]).

        ``capacity``: some pairs may be dropped (id ``E``; Note [Expert capacity] in
        ``capacity.py``), and ``counts_E`` counts the kept ones.
        """
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        layout = sort_by_expert(
            topk_ids_TK, counts_E, pad_multiple=self.pad_multiple, capacity=capacity
        )
        return Routed(
            source=x_TD,
            scores=topk_scores_TK.to(x_TD.dtype),
            layout=layout,
            row_TK=layout.row_TK,
            order_N=layout.order_N if layout.row_N is None else None,
            void_row=layout.void_row,
        )

    def receive(self, routed: Routed) -> Received | None:
        """The rows other ranks sent, once they are here; ``None``: this dispatcher sends none."""
        return None

    def send_back(self, out_RD: torch.Tensor, routed: Routed) -> Any:
        """Start returning the expert outputs of :meth:`receive`'s rows; ``None`` here."""
        return None

    def combine(
        self, local_RD: torch.Tensor, routed: Routed, returning: Any = None
    ) -> torch.Tensor:
        """Sum each token's expert outputs (already weighted by the scores) into ``y_TD``."""
        return unpermute_and_reduce(
            local_RD, routed.row_TK, None, order_N=routed.order_N, void_row=routed.void_row
        )

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """Whether the stages read counts or exchange sizes on the host (so that under
        ``torch.compile`` the layer runs them eagerly: Note [Eager islands under torch.compile]
        in ``layer.py``). Here: ``pad_multiple > 1``, or a ``capacity`` without
        ``pad_to_capacity``, whose row layouts follow host counts."""
        return self.pad_multiple > 1 if capacity is None else not capacity.padded

    def _check_inputs(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> None:
        if x_TD.dim() != 2 or topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(
                f"dispatch expects x_TD (T, D) and topk_ids_TK (T, K) with the same T, got "
                f"{tuple(x_TD.shape)} and {tuple(topk_ids_TK.shape)}"
            )
        if topk_scores_TK.shape != topk_ids_TK.shape:
            raise ValueError(
                f"topk_scores_TK {tuple(topk_scores_TK.shape)} and topk_ids_TK "
                f"{tuple(topk_ids_TK.shape)} must have the same shape"
            )
        if counts_E.shape != (self.num_experts,):
            raise ValueError(
                f"counts_E has shape {tuple(counts_E.shape)}, expected ({self.num_experts},) "
                "(one count per routed expert)"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, "
            f"pad_multiple={self.pad_multiple}, score_before_experts={self.score_before_experts})"
        )
