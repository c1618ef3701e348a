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
one forward needs goes into its metadata (a frozen dataclass that may subclass
:class:`DispatchMetadata`), never onto ``self``.

Note [Deterministic combine]: no step accumulates with atomics or ``index_add``. Forward
gathers rows by index. The weighted combine adds each token's ``K`` weighted rows in ``k``
order, in one pass with no temporary: ``embedding_bag`` in ``"sum"`` mode with the scores as
per-sample weights, which reads each token's rows by index and accumulates them in bag order
(:func:`weighted_row_sum`; never the ``(T * K, D)`` gathered rows). The backward of the token
gather adds the ``K`` row gradients of each token in ``k`` order the same way, unweighted
(:func:`sum_rows`); the backward of the combine writes each row's gradient to its unique
routed row (``index_copy``, or one gather by the inverse permutation when there is no
padding), and the score gradients, one dot product per pair, are ``embedding_bag``'s
per-sample-weight gradient, in one pass (:func:`combine_score_grads`). Results are the same
bits run to run on CPU (tested) and on one CUDA GPU (``tests/test_cuda.py``, run on an H200 in
float32 and bf16; CI has no GPU). Every path (plain, fused routed step, expert-parallel step)
calls these helpers; the plain path and the fused routed step give the same bits as each other.
"""

# ruff: noqa: N803, N806, N812, N815

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dtensor_moe.moe.capacity import Capacity

__all__ = [
    "DispatchMetadata",
    "ExpertLayout",
    "TokenDispatcher",
    "permute_tokens",
    "scores_in_rows",
    "sort_by_expert",
    "unpermute_and_reduce",
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
    """

    token_N: torch.Tensor
    order_N: torch.Tensor
    row_N: torch.Tensor | None
    row_TK: torch.Tensor
    counts_e: torch.Tensor
    num_rows: int
    void_row: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchMetadata:
    """Everything :meth:`TokenDispatcher.combine` needs; returned by ``dispatch``.

    Attributes:
        row_TK: routed-buffer row holding the expert output for pair ``(t, k)``.
        scores_TK: combine weights, or ``None`` when the scores were applied before the
            experts (``score_before_experts``).
        void_row: dropped pairs point at row ``R`` of the expert output, read as zeros (Note
            [The void row]).
        order_N: the pair of each routed row (``ExpertLayout.order_N``) when the rows are a
            permutation of the pairs (no padding, no drop), else ``None``; the combine's
            backward is then one gather.
    """

    row_TK: torch.Tensor
    scores_TK: torch.Tensor | None
    void_row: bool = False
    order_N: torch.Tensor | None = None


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


class _PermuteTokens(torch.autograd.Function):
    """``routed_RD[row_N[n]] = x_TD[token_N[n]]`` (padding rows zero), deterministic backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x_TD: torch.Tensor,
        token_N: torch.Tensor,
        row_N: torch.Tensor | None,
        num_rows: int,
        row_TK: torch.Tensor,
        void_row: bool,
    ) -> torch.Tensor:
        rows_ND = x_TD.index_select(0, token_N)
        if row_N is not None:
            # dropped pairs all land on the void row, which is cut off (Note [The void row])
            buffer = x_TD.new_zeros(num_rows + int(void_row), x_TD.shape[-1])
            rows_ND = buffer.index_copy_(0, row_N, rows_ND)[:num_rows]
        ctx.save_for_backward(row_TK)
        ctx.void_row = void_row
        return rows_ND

    @staticmethod
    def backward(ctx: Any, grad_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (row_TK,) = ctx.saved_tensors
        if ctx.void_row:
            grad_RD = _with_void_row(grad_RD)
        return sum_rows(grad_RD, row_TK), None, None, None, None, None


def permute_tokens(x_TD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Copy tokens into the routed buffer ``(R, D)``; padding rows are zero.

    The backward gathers the ``K`` row gradients of each token and adds them in ``k`` order
    (see Note [Deterministic combine]); padding rows give no gradient.
    """
    return _PermuteTokens.apply(
        x_TD, layout.token_N, layout.row_N, layout.num_rows, layout.row_TK, layout.void_row
    )


def scores_in_rows(scores_TK: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The score of each routed-buffer row (0 on padding rows), differentiable."""
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


def weighted_row_sum(out_RD: torch.Tensor, row_TK: torch.Tensor, s_TK: torch.Tensor) -> torch.Tensor:
    """``y_TD[t] = sum_k s_TK[t, k] * out_RD[row_TK[t, k]]``, added in ``k`` order in one pass
    (Note [Deterministic combine]); ``s_TK`` in ``out_RD``'s dtype. ``row_TK`` may be a
    transposed view."""
    return F.embedding_bag(row_TK, out_RD, per_sample_weights=s_TK, mode="sum")


def sum_rows(src_RD: torch.Tensor, row_TK: torch.Tensor) -> torch.Tensor:
    """``y_TD[t] = sum_k src_RD[row_TK[t, k]]``, added in ``k`` order in one pass: the gradient
    of every token gather (Note [Deterministic combine]). ``row_TK`` may be a transposed view.
    Differentiable to any order when a graph is being built (Note [Double backward])."""
    if torch.is_grad_enabled() and src_RD.requires_grad:
        return src_RD[row_TK].sum(1)
    return F.embedding_bag(row_TK, src_RD, mode="sum")


def _upcast_score_grads(out_RD: torch.Tensor) -> bool:
    """Whether :func:`combine_score_grads` computes in float32 (Note [bf16 score grads off
    CPU]); a function so that a CPU test can take the device branch."""
    return out_RD.dtype == torch.bfloat16 and out_RD.device.type != "cpu"


def combine_score_grads(
    grad_TD: torch.Tensor, out_RD: torch.Tensor, row_TK: torch.Tensor
) -> torch.Tensor:
    """The gradient of :func:`weighted_row_sum` with respect to ``s_TK``: the dot product of each
    token's gradient with each of its rows, ``(T, K)``, in one pass with no temporaries (the
    per-sample-weight gradient of ``embedding_bag``, whose forward is the combine). ``row_TK``
    may be a transposed view. Differentiable when a graph is being built (Note [Double
    backward])."""
    if torch.is_grad_enabled() and (grad_TD.requires_grad or out_RD.requires_grad):
        return (grad_TD.unsqueeze(1) * out_RD[row_TK]).sum(-1)
    T, K = row_TK.shape
    dev = row_TK.device
    if _upcast_score_grads(out_RD):  # Note [bf16 score grads off CPU]
        grad_TD, out_RD = grad_TD.float(), out_RD.float()
    dots_N = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad_TD.contiguous(),
        out_RD,
        row_TK.reshape(-1),
        torch.arange(0, T * K, K, device=dev),  # bag offsets
        torch.arange(T, device=dev).repeat_interleave(K),  # bag of each index
        0,  # mode "sum"
    )
    return dots_N.view(T, K)


# Note [bf16 score grads off CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's CUDA kernel of ``_embedding_bag_per_sample_weights_backward`` is built for float32,
# float64 and float16 only (torch 2.11 and 2.13): with bfloat16 it raises "not implemented for
# 'BFloat16'", which made every bf16 backward of the layer fail on a GPU, the plain, loop and
# expert-parallel paths included (found on an H200; the CPU kernel takes bfloat16). Off the CPU,
# :func:`combine_score_grads` therefore upcasts its two bf16 inputs to float32 first. The kernel
# accumulates in float32 either way, and the callers cast the dots to the scores' dtype (bf16 in
# a bf16 layer) as before, so on the CPU the branch gives the bf16 kernel's bits exactly
# (``tests/test_moe_layer.py`` takes it there and checks that). The cost is the float32 copies
# of ``grad_TD`` and ``out_RD`` (``(T + R) * D * 4`` bytes, freed at once). ``tests/test_cuda.py``
# keeps a test that the plain op still fails, so that this can go when torch gains the kernel,
# and checks the layer in bf16 on the GPU against a float64 reference. Other accelerators take
# the same path rather than be probed.


def combine_row_grads(
    grad_TD: torch.Tensor,
    s_TK: torch.Tensor,
    row_TK: torch.Tensor,
    num_rows: int,
    order_N: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of :func:`weighted_row_sum` with respect to ``out_RD``: row ``row_TK[t, k]``
    gets ``s_TK[t, k] * grad_TD[t]``; rows no pair names get zero. With ``order_N`` (the rows are
    a permutation of the pairs) one gather, no zero fill."""
    K = row_TK.shape[1]
    if order_N is not None:
        token_N = torch.div(order_N, K, rounding_mode="floor")
        scores_N = s_TK.reshape(-1).index_select(0, order_N)
        return grad_TD.index_select(0, token_N).mul_(scores_N.unsqueeze(-1))
    grad_RD = grad_TD.new_zeros(num_rows, grad_TD.shape[-1])
    for k in range(K):
        grad_RD.index_copy_(0, row_TK[:, k], grad_TD * s_TK[:, k : k + 1])
    return grad_RD


class _WeightedCombine(torch.autograd.Function):
    """:func:`weighted_row_sum` with its gradients (:func:`combine_row_grads`,
    :func:`combine_score_grads`); saves ``out_RD`` and the scores."""

    @staticmethod
    def forward(
        ctx: Any,
        out_RD: torch.Tensor,
        row_TK: torch.Tensor,
        scores_TK: torch.Tensor,
        order_N: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(out_RD, row_TK, scores_TK, order_N)
        return weighted_row_sum(out_RD, row_TK, scores_TK.to(out_RD.dtype))

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_RD, row_TK, scores_TK, order_N = ctx.saved_tensors
        grad_out = grad_scores = None
        if ctx.needs_input_grad[0]:
            s_TK = scores_TK.to(out_RD.dtype)
            grad_out = combine_row_grads(grad_TD, s_TK, row_TK, out_RD.shape[0], order_N)
        if ctx.needs_input_grad[2]:
            grad_scores = combine_score_grads(grad_TD, out_RD, row_TK).to(scores_TK.dtype)
        return grad_out, None, grad_scores, None


# Note [Double backward]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A backward with ``create_graph=True`` (a gradient penalty, a Hessian-vector product) runs
# every node's backward with grad mode on, and differentiates what the backwards compute. Two of
# the shared helpers use kernels that cannot be differentiated: ``combine_score_grads`` (an aten
# kernel with no derivative) and ``sum_rows`` (``embedding_bag``, whose own backward has no
# derivative, which ``torch.autograd.functional.hvp`` needs). When grad mode is on and an input
# requires grad, each computes the same values with differentiable ops instead: an explicit
# ``(T, K, D)`` product summed over ``D``, and an indexing summed over ``K`` (equal up to float
# rounding). ``combine_row_grads`` is differentiable as it is. So are the other backwards, and
# ``_compat.local_views``' (the parallel layouts' local views of DTensor weights and inputs),
# which wraps gradients with ``DTensor.from_local`` in grad mode. So the plain path
# (``fused_routed_step=False``) gives exact second derivatives, in one process and under the
# parallel layouts with the plain exchange (``tests/test_moe_layer.py``,
# ``tests/test_parallel_styles.py``: against the per-token reference). The fused routed step and
# the expert-parallel step have hand-written backwards that cannot build a graph: in grad mode
# they raise, on every rank, before computing anything, instead of returning gradients that
# silently miss the terms of their saved weights and activations (which is what
# ``once_differentiable`` does when the incoming gradient does not require grad).


def unpermute_and_reduce(
    out_RD: torch.Tensor,
    row_TK: torch.Tensor,
    scores_TK: torch.Tensor | None,
    *,
    order_N: torch.Tensor | None = None,
    void_row: bool = False,
) -> torch.Tensor:
    """The shared combine tail: ``y_TD[t] = sum_k scores_TK[t, k] * out_RD[row_TK[t, k]]``.

    With ``scores_TK=None`` the ``K`` rows are summed unweighted. Rows not named by ``row_TK``
    (alignment padding) reach neither the output nor the gradients. ``order_N``: the inverse
    of ``row_TK.reshape(-1)`` when that is a permutation of the rows of ``out_RD`` (no padding;
    ``ExpertLayout.order_N``), which makes the backward a single gather. ``void_row``:
    ``row_TK`` may name row ``R``, which reads as zeros (pairs dropped for capacity; Note
    [The void row]).

    The weighted sum runs in one autograd node, :class:`_WeightedCombine`, in one pass (no
    ``(T * K, D)`` gather of the rows; Note [Deterministic combine]). The result is never a
    view: FSDP2 warns about a wrapped module (the experts) that returns one, since an in-place
    op on it would skip FSDP's pre-backward hook.
    """
    T, K = row_TK.shape
    if void_row:
        out_RD = _with_void_row(out_RD)
    if scores_TK is not None:
        return _WeightedCombine.apply(out_RD, row_TK, scores_TK, None if void_row else order_N)
    out_TKD = _UnpermuteRows.apply(out_RD, row_TK.reshape(-1), order_N)
    return out_TKD.view(T, K, out_RD.shape[-1]).sum(dim=1)


class TokenDispatcher:
    """Local (single-rank) dispatch and combine; the base class of parallel dispatchers.

    Keyword Args:
        num_experts: ``E``, routed experts in the whole layer.
        pad_multiple: align each local expert's row group to this multiple (``1``: no padding).
        score_before_experts: scale routed rows by their score before the experts instead of
            weighting expert outputs in combine.

    No collective runs in forward or backward. See Note [Dispatcher steps] for where a
    subclass adds communication, and keep all per-forward state in the returned metadata.
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
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Group tokens by expert.

        ``capacity``: some pairs may be dropped (id ``E``; Note [Expert capacity] in
        ``capacity.py``), and ``counts_E`` counts the kept ones.

        Returns:
            ``(routed_RD, counts_e, metadata)``: the routed buffer, its rows per local expert
            (int64, padding included, summing to ``R``), and what :meth:`combine` needs.
        """
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        layout = sort_by_expert(
            topk_ids_TK, counts_E, pad_multiple=self.pad_multiple, capacity=capacity
        )
        return self._dispatch_rows(x_TD, topk_scores_TK, layout)

    def _dispatch_rows(
        self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, layout: ExpertLayout
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Steps (2) and (3) of Note [Dispatcher steps] on a computed ``layout``."""
        routed_RD = permute_tokens(x_TD, layout)
        scores_TK = topk_scores_TK
        if self.score_before_experts:
            routed_RD = routed_RD * scores_in_rows(topk_scores_TK, layout).unsqueeze(-1)
            scores_TK = None
        return (
            routed_RD,
            layout.counts_e,
            DispatchMetadata(
                row_TK=layout.row_TK,
                scores_TK=scores_TK,
                void_row=layout.void_row,
                order_N=layout.order_N if layout.row_N is None else None,
            ),
        )

    def combine(self, out_RD: torch.Tensor, metadata: DispatchMetadata) -> torch.Tensor:
        """Weight and sum each token's expert outputs back into ``y_TD`` (token order)."""
        return unpermute_and_reduce(
            out_RD,
            metadata.row_TK,
            metadata.scores_TK,
            order_N=metadata.order_N,
            void_row=metadata.void_row,
        )

    def run_experts(
        self,
        experts: Any,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> torch.Tensor:
        """``combine(experts.compute(*dispatch(...)))``: what ``GroupedExperts.forward`` runs.

        A communicating subclass may override it to overlap its exchange with the expert math
        on rows that need no exchange; ``experts`` offers ``compute(routed_RD, counts_e)``,
        ``local_weights()`` and ``compute_path``.

        The local dispatcher (this class's own ``dispatch`` and ``combine``, no padding, scores
        in combine) hands the three steps to ``experts.routed_step`` when the experts offer
        it: one autograd node that saves less for backward (Note [What the experts save for
        backward] in ``experts.py``); it returns ``None`` where it does not apply. A
        ``capacity`` (Note [Expert capacity] in ``capacity.py``) takes the plain steps.
        """
        routed_step = getattr(experts, "routed_step", None)
        if (
            routed_step is not None
            and capacity is None
            and type(self).dispatch is TokenDispatcher.dispatch
            and type(self).combine is TokenDispatcher.combine
            and self.pad_multiple == 1
            and not self.score_before_experts
        ):
            self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
            layout = sort_by_expert(topk_ids_TK, counts_E)
            y_TD = routed_step(x_TD, topk_scores_TK, layout)
            if y_TD is not None:
                return y_TD
            routed_RD, counts_e, metadata = self._dispatch_rows(x_TD, topk_scores_TK, layout)
            return self.combine(experts.compute(routed_RD, counts_e), metadata)
        # the padding, and a capacity without pad_to_capacity, read the counts on the host:
        # one eager island while compiling, as for the loop/bmm paths
        eager = torch.compiler.is_compiling() and self.runs_eagerly_under_compile(capacity)
        steps = _plain_steps_eagerly if eager else _plain_steps
        return steps(self, experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)

    def runs_eagerly_under_compile(self, capacity: Capacity | None = None) -> bool:
        """Whether :meth:`run_experts` reads counts or exchange sizes on the host, and so runs
        eagerly while ``torch.compile`` traces (Note [Eager islands under torch.compile] in
        ``layer.py``). Here: ``pad_multiple > 1``, or a ``capacity`` without
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


def _plain_steps(dispatcher, experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity):
    """``combine(experts.compute(*dispatch(...)))`` under plain autograd."""
    routed_RD, counts_e, metadata = dispatcher.dispatch(
        x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity
    )
    return dispatcher.combine(experts.compute(routed_RD, counts_e), metadata)


# Under torch.compile, ``pad_multiple > 1`` runs dispatch, experts and combine eagerly: the
# padded row layout needs the counts as host ints (``_padding_shift``), and tracing that read
# would break the graph deep inside the dispatch and recompile for new counts.
_plain_steps_eagerly = torch.compiler.disable(
    _plain_steps,
    reason="pad_multiple > 1, or a capacity without pad_to_capacity, lays the routed rows "
    "out by counts read on the host, so dispatch, experts and combine run eagerly: one graph "
    "break; pad_multiple=1 (dropless) or pad_to_capacity=True keeps them in the graph",
)
