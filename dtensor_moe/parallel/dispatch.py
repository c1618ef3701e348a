"""The expert-parallel token dispatcher: count exchange, then variable-split all-to-all.

Shape legend:
    T  tokens routed by this rank
    D  model width
    E  routed experts (global count); e  experts held by this rank (``E // ep``)
    K  experts per token; X = K * replicas rows per token (Note [Expert TP by all-to-all])
    N  rows this rank sends (including its own), sorted by destination rank, then local expert
    M  rows this rank receives from the other ranks, grouped by source rank, then local expert
    R  rows of a routed buffer grouped by local expert, alignment padding included
    P  ranks of the all-to-all mesh (``ep * replicas``)

Note [All-to-all dispatch]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Experts are ``Shard(0)`` over the EP ranks: EP rank ``p`` holds global experts
``[p * e, (p + 1) * e)``. Following Note [Dispatcher steps] in ``dtensor_moe/moe/dispatch.py``:

1. Sort the rows by destination rank and local expert, without padding, and gather the tokens
   (one row per (token, expert) pair). Rows for each rank are contiguous, and inside them the
   rows of each expert.
2. Count exchange: ``all_to_all_single`` of the ``P * e`` per-destination counts with equal
   splits of ``e``. Rank ``p`` receives ``counts_Pe[s, j]``: rows source ``s`` sends to its
   ``j``-th local expert. Every rank sends ``P * e`` counts, so sizes always agree, even when a
   rank routes zero tokens. It is launched before step 1 and waited for after it.
3. Token exchange: a variable-split ``all_to_all_single`` with the send sizes of step 1 and the
   receive sizes of step 2 (read on the host, one sync). Its backward is the reverse exchange.
4. Sort the received rows by local expert (with alignment padding) by calling
   ``sort_by_expert`` again on their ``(M, 1)`` local expert ids.

Combine is the reverse: un-sort the expert outputs back to the received order (the shared tail
``unpermute_and_reduce`` with ``K = 1``), all-to-all them back with the splits swapped, and
weight and sum each token's rows (the shared tail again). Every per-forward value lives in
:class:`AllToAllMetadata` or in local variables; the dispatcher holds only its configuration.

Collectives, on the dispatcher's mesh, every rank the same, sizes agreeing by construction:
forward ``all_to_all_single`` x 3 (counts, tokens, outputs), backward ``all_to_all_single`` x 2
(output grads, token grads). All are functional collectives, so ``CommDebugMode`` sees them.

Note [Expert TP by all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With expert tensor parallelism on a 2-D ``(ep, etp)`` mesh, each of the ``etp`` ranks of an EP
group holds a hidden-dim slice of the same experts. Instead of gathering every token on every
``etp`` rank (an all-gather before and a reduce-scatter after the experts, on top of the EP
all-to-alls), the all-to-all runs over the flattened ``ep * etp`` ranks and sends each row to
all ``replicas = etp`` ranks that hold a slice of its expert: destination ``q = p * etp + j``
for EP rank ``p`` and slice ``j``. Each returns the partial output of its slice, and combine
sums the ``etp`` partials of a row together with its ``K`` experts, in one ``bmm``. This is the
same machinery with ``X = K * etp`` rows per token (:func:`replicate_over_etp`), so the output
is complete (not ``Partial``), every tp rank routes only its own tokens, and a step runs 5
collectives instead of 9. The token gather's backward sums the ``X`` row gradients of a token,
which adds up the ``etp`` partial input gradients.

Note [Overlapped all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:meth:`AllToAllTokenDispatcher.run_experts` (what ``GroupedExperts.forward`` calls) overlaps
both exchanges with the expert math on the rows this rank routes to *itself*, which need no
exchange. The rows are sorted with this rank's own block last, so the rows to send are a prefix
and the own rows a suffix, split in two halves ``own1`` and ``own2``. Forward:

    launch token exchange -> experts(own1) -> wait -> experts(received) ->
    launch output exchange -> experts(own2) -> wait -> combine

Each exchange is launched with the non-autograd ``all_to_all_single`` and joined to the graph
afterwards, by :class:`_RemoteExperts` (token exchange fused with the experts on the received
rows, ``grouped_mm`` path) or :class:`_Exchange` (output exchange; token exchange on the other
paths), whose nodes are created *after* the overlapped compute. Autograd runs ready nodes
newest first, so the backward is the mirror image: the output exchange's reverse is launched
(not waited for) before ``experts(own2)``'s backward runs; ``_RemoteExperts`` computes the
input gradient, launches the token exchange's reverse, and only then computes the three weight
gradients, followed by ``experts(own1)``'s backward. The exchange after the longest compute
phase, where ranks arrive furthest apart, thus has the most work to hide behind. The number
and sizes of the collectives are those of Note [All-to-all dispatch]. With ``pad_multiple > 1``
the plain ``dispatch`` / ``compute`` / ``combine`` path runs instead.
"""

# ruff: noqa: N803, N806, N815

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from dtensor_moe.moe.dispatch import (
    DispatchMetadata,
    TokenDispatcher,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    unpermute_and_reduce,
)
from dtensor_moe.moe.experts import grouped_swiglu, resolve_compute_path

__all__ = ["AllToAllMetadata", "AllToAllTokenDispatcher"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AllToAllMetadata(DispatchMetadata):
    """What :meth:`AllToAllTokenDispatcher.combine` needs; see Note [All-to-all dispatch].

    Attributes:
        row_TK: row of pair ``(t, k)`` among the ``N`` rows this rank sent.
        scores_TK: combine weights, or ``None`` (``score_before_experts``).
        input_splits: rows sent to each EP rank.
        output_splits: rows received from each EP rank.
        received_row_M1: routed-buffer row of each received row, shape ``(M, 1)``.
    """

    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    received_row_M1: torch.Tensor


def replicate_over_etp(
    topk_ids_TK: torch.Tensor, counts_E: torch.Tensor, *, experts_per_rank: int, replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination ids of every (token, expert, replica) row and their counts.

    See Note [Expert TP by all-to-all]. Returns ``ids_TX`` of shape ``(T, K * replicas)``
    (``k``-major, replica-minor), holding ``q * e + local_expert`` for destination rank ``q``,
    and ``counts_X`` (``(P * e,)``): ``counts_E`` with each EP rank's block repeated
    ``replicas`` times.
    """
    e, R = experts_per_rank, replicas
    g_TK1 = topk_ids_TK.unsqueeze(-1)
    j = torch.arange(R, device=topk_ids_TK.device)
    ids_TKR = (torch.div(g_TK1, e, rounding_mode="floor") * R + j) * e + g_TK1.remainder(e)
    ep = counts_E.numel() // e
    counts_X = counts_E.view(ep, 1, e).expand(ep, R, e).reshape(-1)
    return ids_TKR.flatten(1), counts_X


def _split_counts(counts: list[int], rows: int) -> tuple[list[int], list[int]]:
    """Per-expert counts of the first ``rows`` rows of a group-sorted block, and of the rest."""
    first = []
    for c in counts:
        first.append(min(c, rows))
        rows -= first[-1]
    return first, [c - f for c, f in zip(counts, first)]


class _Exchange(torch.autograd.Function):
    """The rows of an all-to-all launched earlier; backward launches the reverse one.

    ``forward(sent, pending, recv_splits, send_splits, mesh)`` waits for ``pending`` (the
    all-to-all of ``sent`` already in flight) and returns the received rows. ``backward`` starts
    the reverse all-to-all and returns its result *without waiting*, so that autograd runs other
    ready work before the gradient is used. See Note [Overlapped all-to-all].
    """

    @staticmethod
    def forward(
        ctx: Any,
        sent: torch.Tensor,
        pending: torch.Tensor,
        recv_splits: list[int],
        send_splits: list[int],
        mesh: DeviceMesh,
    ) -> torch.Tensor:
        ctx.recv_splits, ctx.send_splits, ctx.mesh = recv_splits, send_splits, mesh
        return funcol.wait_tensor(pending)

    @staticmethod
    def backward(ctx: Any, grad_MD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_ND = funcol.all_to_all_single(
            grad_MD.contiguous(), ctx.send_splits, ctx.recv_splits, ctx.mesh
        )
        return grad_ND, None, None, None, None


@dataclass(frozen=True, slots=True)
class _Splits:
    """Row counts of one exchange: ``recv`` from and ``send`` to each rank of ``mesh``."""

    recv: list[int]
    send: list[int]
    mesh: DeviceMesh


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def _swiglu_forward(
    x_RD: torch.Tensor, w1_eHD: torch.Tensor, w2_eDH: torch.Tensor, w3_eHD: torch.Tensor, offs
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Grouped SwiGLU on row groups ending at ``offs``; returns the output and what backward needs.

    The same ``grouped_mm`` calls as ``grouped_swiglu``; the backward is
    :func:`_swiglu_input_grad` then :func:`_swiglu_weight_grads`.
    """
    gate_RH = _gmm(x_RD, w1_eHD.transpose(-2, -1), offs)
    up_RH = _gmm(x_RD, w3_eHD.transpose(-2, -1), offs)
    h_RH = torch.nn.functional.silu(gate_RH) * up_RH
    return _gmm(h_RH, w2_eDH.transpose(-2, -1), offs), (x_RD, gate_RH, up_RH, h_RH)


def _swiglu_input_grad(
    grad_RD: torch.Tensor, saved: tuple[torch.Tensor, ...], weights: tuple, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x_RD, grad_gate_RH, grad_up_RH)`` of :func:`_swiglu_forward`."""
    _, gate_RH, up_RH, _ = saved
    w1_eHD, w2_eDH, w3_eHD = weights
    grad_h_RH = _gmm(grad_RD, w2_eDH, offs)
    grad_gate_RH = torch.ops.aten.silu_backward(grad_h_RH * up_RH, gate_RH)
    grad_up_RH = grad_h_RH * torch.nn.functional.silu(gate_RH)
    grad_x_RD = _gmm(grad_gate_RH, w1_eHD, offs) + _gmm(grad_up_RH, w3_eHD, offs)
    return grad_x_RD, grad_gate_RH, grad_up_RH


def _swiglu_weight_grads(
    grad_RD: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    grad_gate_RH: torch.Tensor,
    grad_up_RH: torch.Tensor,
    offs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_w1, grad_w2, grad_w3)`` of :func:`_swiglu_forward`."""
    x_RD, _, _, h_RH = saved
    grad_w2 = _gmm(grad_RD.t(), h_RH, offs)
    grad_w1 = _gmm(grad_gate_RH.t(), x_RD, offs)
    grad_w3 = _gmm(grad_up_RH.t(), x_RD, offs)
    return grad_w1, grad_w2, grad_w3


class _LocalExperts(torch.autograd.Function):
    """SwiGLU experts on rows that stay on this rank (``grouped_mm`` path), one autograd node.

    ``forward(x_RD, w1, w2, w3, offs)``: the math of ``grouped_swiglu`` with the same
    ``grouped_mm`` calls, but one node instead of about ten (three grouped matmuls, their
    contiguous-gradient guards, ``silu`` and two products), so the backward runs with less
    autograd and Python work per chunk. Backward: :func:`_swiglu_input_grad` and
    :func:`_swiglu_weight_grads`; the incoming gradient is made contiguous first (Note
    [grouped_mm expanded grad] in ``dtensor_moe/moe/experts.py``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_RD: torch.Tensor,
        w1_eHD: torch.Tensor,
        w2_eDH: torch.Tensor,
        w3_eHD: torch.Tensor,
        offs: torch.Tensor,
    ) -> torch.Tensor:
        out_RD, saved = _swiglu_forward(x_RD, w1_eHD, w2_eDH, w3_eHD, offs)
        ctx.save_for_backward(*saved, w1_eHD, w2_eDH, w3_eHD)
        ctx.offs = offs
        return out_RD

    @staticmethod
    def backward(ctx: Any, grad_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, w1_eHD, w2_eDH, w3_eHD = ctx.saved_tensors
        grad_RD = grad_RD.contiguous()
        weights = (w1_eHD, w2_eDH, w3_eHD)
        grad_x_RD, grad_gate_RH, grad_up_RH = _swiglu_input_grad(grad_RD, saved, weights, ctx.offs)
        grad_ws = _swiglu_weight_grads(grad_RD, saved, grad_gate_RH, grad_up_RH, ctx.offs)
        return grad_x_RD, *grad_ws, None


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """``grouped_mm`` group ends (int32) of host counts."""
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _own_experts(x_RD: torch.Tensor, weights: tuple, counts: list[int], path: str) -> torch.Tensor:
    """Experts on this rank's own rows: :class:`_LocalExperts` on the ``grouped_mm`` path."""
    if resolve_compute_path(path, x_RD, weights[0], counts) != "grouped_mm":
        return grouped_swiglu(x_RD, *weights, counts, path)
    return _LocalExperts.apply(x_RD, *weights, _offsets(counts, x_RD.device))


class _RemoteExperts(torch.autograd.Function):
    """Token exchange + SwiGLU experts on the received rows (``grouped_mm`` path).

    ``forward(sent_ND, pending, w1, w2, w3, splits, token_R, row_M, counts_e)`` waits for the
    token exchange (``pending``), sorts the received rows by local expert (``token_R``), runs
    the experts and returns their outputs in the received order (``row_M``). ``backward``
    computes the input gradient first, launches the reverse exchange *without waiting*, and only
    then the three weight gradients, so that the exchange, and the other ranks' lateness,
    overlaps them (Note [Overlapped all-to-all]). The math is the SwiGLU backward that autograd
    would run, with the same ``grouped_mm`` calls.
    """

    @staticmethod
    def forward(
        ctx: Any,
        sent_ND: torch.Tensor,
        pending: torch.Tensor,
        w1_eHD: torch.Tensor,
        w2_eDH: torch.Tensor,
        w3_eHD: torch.Tensor,
        splits: _Splits,
        token_R: torch.Tensor,
        row_M: torch.Tensor,
        counts_e: torch.Tensor,
    ) -> torch.Tensor:
        routed_RD = funcol.wait_tensor(pending).index_select(0, token_R)
        offs = torch.cumsum(counts_e, 0, dtype=torch.int32)
        out_RD, saved = _swiglu_forward(routed_RD, w1_eHD, w2_eDH, w3_eHD, offs)
        ctx.save_for_backward(*saved, w1_eHD, w2_eDH, w3_eHD)
        ctx.splits, ctx.token_R, ctx.row_M, ctx.offs = splits, token_R, row_M, offs
        return out_RD.index_select(0, row_M)

    @staticmethod
    def backward(ctx: Any, grad_MD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, w1_eHD, w2_eDH, w3_eHD = ctx.saved_tensors
        offs, splits = ctx.offs, ctx.splits
        grad_RD = grad_MD.index_select(0, ctx.token_R)
        grad_x_RD, grad_gate_RH, grad_up_RH = _swiglu_input_grad(
            grad_RD, saved, (w1_eHD, w2_eDH, w3_eHD), offs
        )
        grad_sent = funcol.all_to_all_single(
            grad_x_RD.index_select(0, ctx.row_M), splits.send, splits.recv, splits.mesh
        )
        grad_ws = _swiglu_weight_grads(grad_RD, saved, grad_gate_RH, grad_up_RH, offs)
        return grad_sent, None, *grad_ws, None, None, None, None


class AllToAllTokenDispatcher(TokenDispatcher):
    """Expert-parallel dispatch and combine over a 1-D mesh; see Note [All-to-all dispatch].

    Keyword Args:
        num_experts: ``E``, routed experts in the whole layer.
        mesh: 1-D mesh of the ranks that receive rows, in the order of Note [Expert TP by
            all-to-all]: rank ``q`` holds experts ``[(q // replicas) * e, ...)`` (``e = E * replicas
            / P``) and hidden slice ``q % replicas``. ``None``: no exchange, all experts local.
        replicas: ``etp``, the ranks that each hold a hidden slice of the same experts; every
            row is sent to all of them and their partial outputs are summed in combine. ``1``
            without expert tensor parallelism.
        partial_mesh: 1-D mesh over which the expert outputs are partial sums because the
            tokens were gathered, not replicated by the all-to-all (``ExpertTensorParallel(
            dispatch="gather")``); :meth:`combine` then returns a ``Partial`` DTensor on it, so
            that a missing reduction cannot go unnoticed. ``None``: a plain tensor.
        pad_multiple: align each local expert's row group to this multiple.
        score_before_experts: scale rows by their score before the experts.

    Forward: ``all_to_all_single`` x 3 on ``mesh`` (counts, tokens, outputs); backward:
    ``all_to_all_single`` x 2. No collective when ``mesh`` is ``None``.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        mesh: DeviceMesh | None,
        replicas: int = 1,
        partial_mesh: DeviceMesh | None = None,
        pad_multiple: int = 1,
        score_before_experts: bool = False,
    ) -> None:
        super().__init__(
            num_experts=num_experts,
            pad_multiple=pad_multiple,
            score_before_experts=score_before_experts,
        )
        for name, m in (("mesh", mesh), ("partial_mesh", partial_mesh)):
            if m is not None and m.ndim != 1:
                raise ValueError(f"{name} must be a 1-D DeviceMesh, got a {m.ndim}-D mesh")
        size = 1 if mesh is None else mesh.size()
        if replicas < 1 or size % replicas != 0 or num_experts % (size // replicas) != 0:
            raise ValueError(
                f"AllToAllTokenDispatcher: the mesh of {size} ranks must hold whole groups of "
                f"replicas={replicas} ranks, and num_experts={num_experts} must be divisible by "
                f"the expert-parallel degree {size // max(replicas, 1)}"
            )
        self.mesh = mesh
        self.replicas = replicas
        self.partial_mesh = partial_mesh

    @property
    def ep_size(self) -> int:
        """Ranks that hold different experts: the mesh size over ``replicas``."""
        return 1 if self.mesh is None else self.mesh.size() // self.replicas

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Send each (token, expert) row to the ranks holding the expert; see the module Note."""
        if self.mesh is None:
            return super().dispatch(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        P, e = self.mesh.size(), self.num_experts // self.ep_size
        ids_TX, scores_TX, counts_X = topk_ids_TK, topk_scores_TK, counts_E
        if self.replicas > 1:
            ids_TX, counts_X = replicate_over_etp(
                topk_ids_TK, counts_E, experts_per_rank=e, replicas=self.replicas
            )
            scores_TX = topk_scores_TK.repeat_interleave(self.replicas, dim=1)
        # The count exchange runs while this rank sorts and gathers its rows.
        counts_in = funcol.all_to_all_single(counts_X, None, None, self.mesh)
        layout = sort_by_expert(ids_TX, counts_X)
        sent_ND = permute_tokens(x_TD, layout)
        if self.score_before_experts:
            sent_ND = sent_ND * scores_in_rows(scores_TX, layout).unsqueeze(-1)
            scores_TX = None
        counts_Pe = funcol.wait_tensor(counts_in).view(P, e)
        input_splits = counts_X.view(P, e).sum(1).tolist()
        output_splits = counts_Pe.sum(1).tolist()
        received_MD = funcol.all_to_all_single_autograd(
            sent_ND, output_splits, input_splits, self.mesh
        )
        # The local sort needs only the counts: it runs while the rows are in flight.
        local_ids_M = torch.repeat_interleave(
            torch.arange(e, device=counts_E.device).repeat(P), counts_Pe.reshape(-1)
        )
        local = sort_by_expert(
            local_ids_M.unsqueeze(1), counts_Pe.sum(0), pad_multiple=self.pad_multiple
        )
        metadata = AllToAllMetadata(
            row_TK=layout.row_TK,
            scores_TK=scores_TX,
            input_splits=tuple(input_splits),
            output_splits=tuple(output_splits),
            received_row_M1=local.row_TK,
        )
        return permute_tokens(received_MD, local), local.counts_e, metadata

    def run_experts(
        self,
        experts: Any,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        """Dispatch, expert math and combine, with both exchanges overlapped with local rows.

        See Note [Overlapped all-to-all]. Falls back to ``dispatch`` / ``compute`` /
        ``combine`` without a mesh or with ``pad_multiple > 1``.
        """
        if self.mesh is None or self.pad_multiple != 1:
            return super().run_experts(experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        P, e, me = self.mesh.size(), self.num_experts // self.ep_size, self.mesh.get_local_rank()
        ids_TX, scores_TX, counts_X = self._destinations(topk_scores_TK, topk_ids_TK, counts_E)
        counts_in = funcol.all_to_all_single(counts_X, None, None, self.mesh)
        # Sort by destination with this rank's own rows last: the rows to send are a prefix.
        position_P = torch.tensor([*range(me), *range(me + 1, P), me], device=counts_X.device)
        rank_at_P = torch.empty_like(position_P).index_put_((position_P,), torch.arange(P))
        counts_Pe = counts_X.view(P, e)
        ids_TX = rank_at_P[torch.div(ids_TX, e, rounding_mode="floor")] * e + ids_TX.remainder(e)
        layout = sort_by_expert(ids_TX, counts_Pe[position_P].reshape(-1))
        sent_ND = permute_tokens(x_TD, layout)
        if self.score_before_experts:
            sent_ND = sent_ND * scores_in_rows(scores_TX, layout).unsqueeze(-1)
            scores_TX = None
        own_e = counts_Pe[me].tolist()
        send = counts_Pe.sum(1).tolist()
        send[me] = 0
        remote_ND, own_ND = sent_ND.split([sum(send), sum(own_e)])
        received_Pe = funcol.wait_tensor(counts_in).view(P, e).clone()
        received_Pe[me] = 0
        recv = received_Pe.sum(1).tolist()
        pending = funcol.all_to_all_single(remote_ND.detach(), recv, send, self.mesh)
        weights, path = experts.local_weights(), experts.compute_path
        own1_e, own2_e = _split_counts(own_e, sum(own_e) // 2)
        own1_ND, own2_ND = own_ND.split([sum(own1_e), sum(own2_e)])
        out1_ND = _own_experts(own1_ND, weights, own1_e, path)
        remote_out_MD = self._remote_experts(
            remote_ND,
            pending,
            _Splits(recv=recv, send=send, mesh=self.mesh),
            received_Pe,
            weights,
            path,
        )
        pending = funcol.all_to_all_single(remote_out_MD.detach(), send, recv, self.mesh)
        out2_ND = _own_experts(own2_ND, weights, own2_e, path)
        returned_ND = _Exchange.apply(remote_out_MD, pending, send, recv, self.mesh)
        out_ND = torch.cat([returned_ND, out1_ND, out2_ND])
        y_TD = unpermute_and_reduce(out_ND, layout.row_TK, scores_TX, order_N=layout.order_N)
        return self._finish(y_TD)

    def _destinations(
        self, topk_scores_TK: torch.Tensor, topk_ids_TK: torch.Tensor, counts_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row destination ids ``q * e + j``, their scores and counts (replicas expanded)."""
        if self.replicas == 1:
            return topk_ids_TK, topk_scores_TK, counts_E
        e = self.num_experts // self.ep_size
        ids_TX, counts_X = replicate_over_etp(
            topk_ids_TK, counts_E, experts_per_rank=e, replicas=self.replicas
        )
        return ids_TX, topk_scores_TK.repeat_interleave(self.replicas, dim=1), counts_X

    @staticmethod
    def _remote_experts(
        remote_ND: torch.Tensor,
        pending: torch.Tensor,
        splits: _Splits,
        received_Pe: torch.Tensor,
        weights: tuple,
        path: str,
    ) -> torch.Tensor:
        """Expert math on the rows received from other ranks, in the received order.

        On the ``grouped_mm`` path, :class:`_RemoteExperts` fuses it with the token exchange so
        that the backward launches the reverse exchange before the weight gradients.
        """
        P, e = received_Pe.shape
        local_ids_M = torch.repeat_interleave(
            torch.arange(e, device=received_Pe.device).repeat(P), received_Pe.reshape(-1)
        )
        local = sort_by_expert(local_ids_M.unsqueeze(1), received_Pe.sum(0))
        rows = int(received_Pe.sum())
        probe = remote_ND.new_empty(rows, remote_ND.shape[-1])
        counts = local.counts_e.tolist()
        if resolve_compute_path(path, probe, weights[0], counts) == "grouped_mm":
            return _RemoteExperts.apply(
                remote_ND,
                pending,
                *weights,
                splits,
                local.token_N,
                local.row_TK[:, 0],
                local.counts_e,
            )
        received_MD = _Exchange.apply(remote_ND, pending, splits.recv, splits.send, splits.mesh)
        out_RD = grouped_swiglu(permute_tokens(received_MD, local), *weights, counts, path)
        return unpermute_and_reduce(out_RD, local.row_TK, None, order_N=local.order_N)

    def _finish(self, y_TD: torch.Tensor) -> torch.Tensor:
        if self.partial_mesh is None:
            return y_TD
        return DTensor.from_local(y_TD, self.partial_mesh, [Partial()], run_check=False)

    def combine(self, out_RD: torch.Tensor, metadata: DispatchMetadata) -> torch.Tensor:
        """Send expert outputs back and reduce each token's rows (``y_TD``)."""
        if self.mesh is None:
            y_TD = super().combine(out_RD, metadata)
        else:
            assert isinstance(metadata, AllToAllMetadata), f"got {type(metadata).__name__}"
            received_MD = unpermute_and_reduce(out_RD, metadata.received_row_M1, None)
            returned_ND = funcol.all_to_all_single_autograd(
                received_MD,
                list(metadata.input_splits),
                list(metadata.output_splits),
                self.mesh,
            )
            y_TD = unpermute_and_reduce(returned_ND, metadata.row_TK, metadata.scores_TK)
        return self._finish(y_TD)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"replicas={self.replicas}, partial={self.partial_mesh is not None}, "
            f"pad_multiple={self.pad_multiple}, score_before_experts={self.score_before_experts})"
        )
