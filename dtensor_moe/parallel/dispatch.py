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
(output grads, token grads). ``CommDebugMode`` sees them all: functional collectives on the
plain path, ``all_to_all_single`` calls on the one-node path of Note [Overlapped all-to-all].

Note [Expert TP by all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With expert tensor parallelism on a 2-D ``(ep, etp)`` mesh, each of the ``etp`` ranks of an EP
group holds a hidden-dim slice of the same experts. Instead of gathering every token on every
``etp`` rank (an all-gather before and a reduce-scatter after the experts, on top of the EP
all-to-alls), the all-to-all runs over the flattened ``ep * etp`` ranks and sends each row to
all ``replicas = etp`` ranks that hold a slice of its expert: destination ``q = p * etp + j``
for EP rank ``p`` and slice ``j``. Each returns the partial output of its slice, and combine
sums the ``etp`` partials of a row together with its ``K`` experts, in one pass. This is the
same machinery with ``X = K * etp`` rows per token (:func:`replicate_over_etp`), so the output
is complete (not ``Partial``), every tp rank routes only its own tokens, and a step runs 5
collectives instead of 9. The token gather's backward sums the ``X`` row gradients of a token,
which adds up the ``etp`` partial input gradients.

Note [Overlapped all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:meth:`AllToAllTokenDispatcher.run_experts` (what ``GroupedExperts.forward`` calls) runs the
whole dispatch -> experts -> combine of Note [All-to-all dispatch] as *one* autograd node,
:class:`_ExpertParallelStep`, and overlaps both exchanges with the expert math on the rows this
rank routes to *itself*, which need no exchange. The rows are sorted with this rank's own block
last, so the rows to send are a prefix and the own rows a suffix. The own rows' math is split
by operation, not by rows, so that it stays one ``grouped_mm`` per weight: the gate projection
(a third of it) overlaps the token exchange and the rest (two thirds) the output exchange,
whose wait is the longer one. Forward:

    launch count exchange -> sort, gather rows -> wait -> launch token exchange ->
    own gate projection -> wait -> experts(received) -> launch output exchange ->
    rest of experts(own) -> wait -> combine

and the backward, written out by hand in the mirror order:

    combine backward -> launch reverse output exchange -> experts(own) backward -> wait ->
    input gradient of experts(received) -> launch reverse token exchange -> weight gradients
    of experts(received) -> wait -> token gather backward

The own rows' whole backward goes before the first wait, while its operands are still in
cache; the received rows' weight gradients are enough work to cover the second.

Why one node, and why ``torch.distributed.all_to_all_single(async_op=True)`` rather than the
functional collectives: on CPU, where four ranks share the cores, a step is bound by CPU time,
and the per-op autograd bookkeeping and the functional wrappers (``AsyncCollectiveTensor``,
pytree maps) cost more than the row gathers. Inside the node the ops run without autograd
recording, the exchanges are launched directly, and the order of the steps is explicit instead
of relying on autograd's scheduling. ``CommDebugMode`` still sees every exchange (as
``c10d.alltoall_base_``), so the collective counts stay pinned in the tests. Dead exchange
buffers are reused for the next exchange of the same size: fresh multi-megabyte buffers cost
page faults on CPU. The math is the same ``grouped_mm`` calls as ``grouped_swiglu``, through
the SwiGLU helpers the fused routed step uses too (Note [SwiGLU steps on grouped_mm] in
``dtensor_moe/moe/experts.py``); the gradients match the autograd of ``permute_tokens`` ->
``grouped_swiglu`` -> ``unpermute_and_reduce`` up to float rounding (the combine adds the
``X`` rows of a token in ``x`` order).

With ``pad_multiple > 1``, ``score_before_experts``, ``pad_to_capacity`` (the static exchange
of Note [Static exchange at capacity]), or a compute path other than ``grouped_mm`` (an
unsupported dtype or alignment, or a forced ``loop``/``bmm``), the plain ``dispatch`` /
``compute`` / ``combine`` path runs instead, with the same collectives through
``all_to_all_single_autograd``. A capacity without padding runs here: its dropped pairs get
destination ``G`` (one past every expert), whose sort key puts them after the own rows; they
are neither sent nor computed, their output rows are zero, and their rows' gradients are
dropped (Note [The void row] in ``dtensor_moe/moe/dispatch.py``).
"""

# ruff: noqa: N803, N806, N815

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from dtensor_moe.moe.capacity import Capacity
from dtensor_moe.moe.dispatch import (
    DispatchMetadata,
    TokenDispatcher,
    combine_row_grads,
    combine_score_grads,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    sum_rows,
    unpermute_and_reduce,
    weighted_row_sum,
)
from dtensor_moe.moe.experts import (
    _gate_up_grads,
    _gmm,
    _grouped_mm_supported,
    _swiglu_forward,
    _swiglu_saved,
    _w2_grad,
    _w13_grads,
    _x_grad,
)
from dtensor_moe.parallel.mesh import local_rank, mesh_ranks

__all__ = ["AllToAllMetadata", "AllToAllTokenDispatcher"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AllToAllMetadata(DispatchMetadata):
    """What :meth:`AllToAllTokenDispatcher.combine` needs; see Note [All-to-all dispatch].

    Attributes:
        row_TK: row of pair ``(t, k)`` among the ``N`` rows this rank sent.
        scores_TK: combine weights, or ``None`` (``score_before_experts``).
        input_splits: rows sent to each EP rank.
        output_splits: rows received from each EP rank.
        received_row_M1: routed-buffer row of each received row, shape ``(M, 1)``; ``None``
            for the static exchange at capacity (Note [Static exchange at capacity]), whose
            received rows are ``(P, e, C)`` blocks.
    """

    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    received_row_M1: torch.Tensor | None


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


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """``grouped_mm`` group ends (int32) of host counts."""
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _block_sums(counts: list[int], e: int) -> list[int]:
    """Sums of consecutive blocks of ``e`` host counts: rows per rank of ``P * e`` counts."""
    return [sum(counts[i : i + e]) for i in range(0, len(counts), e)]


@dataclass(frozen=True, slots=True)
class _Route:
    """Where the rows of one forward go: fixed by the routing, kept for the backward.

    ``send``/``recv``: rows to and from each rank (0 for this rank: its own rows stay).
    ``n_kept``: the sorted rows that go to an expert, sent or own; the rows after them are
    pairs dropped for capacity (Note [The void row] in ``dtensor_moe/moe/dispatch.py``).
    ``offs_own``/``offs_recv``: ``grouped_mm`` group ends of the own and the received rows.
    """

    group: Any
    send: list[int]
    recv: list[int]
    n_send: int
    n_recv: int
    n_kept: int
    offs_own: torch.Tensor
    offs_recv: torch.Tensor


class _ExpertParallelStep(torch.autograd.Function):
    """Dispatch, experts and combine of one expert-parallel forward as one autograd node.

    ``forward(x_TD, scores_TX, w1, w2, w3, ids_TX, counts_X, group, key_G, e, me,
    recompute)`` returns ``y_TD``; ``backward`` returns the gradients of ``x_TD``,
    ``scores_TX`` and the three local weights. See Note [Overlapped all-to-all] for the order of
    the steps; the math is that of ``permute_tokens`` -> ``grouped_swiglu`` ->
    ``unpermute_and_reduce`` with the exchanges of Note [All-to-all dispatch] in between, with
    the same ``grouped_mm`` calls.

    Saved for backward (Note [What the experts save for backward] in ``experts.py``): the
    received rows in expert order (their source is on other ranks), but not the own rows (a
    gather of ``x_TD``, redone in backward); the pre-activations ``gate``/``up`` of both parts
    (none with ``recompute``: backward recomputes them), not ``silu(gate)`` nor the product;
    and the ``N x D`` expert outputs, whose dot products with the token gradients give the
    score gradients on this rank (the received rows' outputs were computed on other ranks).
    Backward computes a weight's gradient only when the weight requires one: frozen experts
    (fine-tuning the rest of the model) skip their six weight-gradient ``grouped_mm`` calls, and
    the own rows are then gathered again only for a recompute. The exchanges are the same.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_TD: torch.Tensor,
        scores_TX: torch.Tensor,
        w1_eHD: torch.Tensor,
        w2_eDH: torch.Tensor,
        w3_eHD: torch.Tensor,
        ids_TX: torch.Tensor,
        counts_X: torch.Tensor,
        group: Any,
        key_G: torch.Tensor,
        e: int,
        me: int,
        recompute: bool,
    ) -> torch.Tensor:
        T, X = ids_TX.shape
        D, N, dev = x_TD.shape[-1], ids_TX.numel(), x_TD.device
        counts_in = torch.empty_like(counts_X)
        counts_work = dist.all_to_all_single(counts_in, counts_X, group=group, async_op=True)
        # Sort by destination rank (this rank's own block last), then local expert, then token.
        order_N = torch.argsort(key_G[ids_TX.reshape(-1)], stable=True)
        token_N = torch.div(order_N, X, rounding_mode="floor")
        row_N = torch.empty_like(order_N).index_put_((order_N,), torch.arange(N, device=dev))
        sent_ND = x_TD.index_select(0, token_N)
        counts_work.wait()
        sent, received = torch.stack((counts_X, counts_in)).tolist()
        P = len(sent) // e
        send, recv = _block_sums(sent, e), _block_sums(received, e)
        n_kept = sum(sent)  # the rows past it were dropped for capacity: key G, sorted last
        send[me] = recv[me] = 0
        n_send, n_recv = sum(send), sum(recv)
        recv_MD = x_TD.new_empty(n_recv, D)
        token_work = dist.all_to_all_single(
            recv_MD, sent_ND[:n_send], recv, send, group=group, async_op=True
        )
        # While the rows travel: the expert order of the received rows, then the own rows' gate.
        received_Pe = counts_in.view(P, e).clone()
        received_Pe[me] = 0
        local_ids_M = torch.arange(e, device=dev).repeat(P).repeat_interleave(received_Pe.view(-1))
        token_M = torch.argsort(local_ids_M, stable=True)
        row_M = torch.empty_like(token_M).index_put_((token_M,), torch.arange(n_recv, device=dev))
        recv_e = [
            sum(received[q * e + j] for q in range(P)) - received[me * e + j] for j in range(e)
        ]
        offs_own = _offsets(sent[me * e : (me + 1) * e], dev)
        offs_recv = _offsets(recv_e, dev)
        route = _Route(group, send, recv, n_send, n_recv, n_kept, offs_own, offs_recv)
        weights = (w1_eHD, w2_eDH, w3_eHD)
        own_RD = sent_ND[n_send:n_kept]
        # A third of the own rows' math before the token exchange's wait, two thirds before the
        # output exchange's: the second wait is the longer one (Note [Overlapped all-to-all]).
        own_gate_RH = _gmm(own_RD, w1_eHD.transpose(-2, -1), offs_own)
        token_work.wait()
        routed_RD = recv_MD.index_select(0, token_M)
        recv_out, recv_saved = _swiglu_forward(routed_RD, *weights, route.offs_recv)
        # Scratch buffers are reused once dead: fresh large buffers cost page faults on CPU.
        back_MD = torch.index_select(recv_out, 0, row_M, out=recv_MD)
        out_ND = x_TD.new_empty(N, D)
        out_work = dist.all_to_all_single(
            out_ND[:n_send], back_MD, send, recv, group=group, async_op=True
        )
        own_out, own_saved = _swiglu_forward(own_RD, *weights, offs_own, own_gate_RH)
        out_ND[n_send:n_kept].copy_(own_out)
        out_ND[n_kept:].zero_()  # dropped pairs add nothing and their scores get no gradient
        out_work.wait()
        # Combine: y[t] = sum_x s[t, x] * out[row(t, x)], the shared weighted sum (x order, one
        # pass; Note [Deterministic combine] in dtensor_moe/moe/dispatch.py).
        y_TD = weighted_row_sum(out_ND, row_N.view(T, X), scores_TX.to(x_TD.dtype))
        ctx.route = route
        hidden = () if recompute else (*own_saved, *recv_saved)
        ctx.save_for_backward(
            x_TD, routed_RD, *weights, out_ND, scores_TX, order_N, token_N, row_N, token_M,
            row_M, *hidden,
        )  # fmt: skip
        return y_TD

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True; checked on every rank, before any exchange
            raise RuntimeError(
                "the overlapped expert-parallel MoE step cannot be differentiated twice "
                "(backward with create_graph=True, for a gradient penalty or a Hessian-vector "
                "product); build the layer with ExpertParallel(overlap=False) or "
                "parallelize_moe(..., ep_overlap=False), whose plain exchange supports it "
                "(Note [Double backward] in dtensor_moe/moe/dispatch.py), or call backward with "
                "create_graph=False"
            )
        saved = ctx.saved_tensors
        x_TD, routed_RD, weights = saved[0], saved[1], saved[2:5]
        out_ND, scores_TX, order_N, token_N, row_N, token_M, row_M = saved[5:12]
        hidden = saved[12:]
        route = ctx.route
        T, X = scores_TX.shape
        D, row_TX = out_ND.shape[-1], row_N.view(T, X)
        n_send, n_kept = route.n_send, route.n_kept
        need = ctx.needs_input_grad
        need_w13 = (need[2], need[4])  # frozen experts: no weight gradients (nor their rows)
        x_own_RD = None
        if not hidden or any(need_w13):
            x_own_RD = x_TD.index_select(0, token_N[n_send:n_kept])
        own_saved = _swiglu_saved(x_own_RD, hidden[:2], weights, route.offs_own)
        # The combine's backward, by the plain combine's helpers: the score's gradient is the
        # dot product of the token's gradient with the row's output; each sorted row's gradient
        # is the token's gradient times the score (one gather: the rows are the pairs, sorted).
        grad_scores_TX = None
        if need[1]:
            grad_scores_TX = combine_score_grads(grad_TD, out_ND, row_TX).to(scores_TX.dtype)
        s_TX = scores_TX.to(grad_TD.dtype)
        grad_ND = combine_row_grads(grad_TD, s_TX, row_TX, out_ND.shape[0], order_N)
        grad_recv_MD = grad_TD.new_empty(route.n_recv, D)
        work = dist.all_to_all_single(
            grad_recv_MD, grad_ND[:n_send], route.recv, route.send, group=route.group, async_op=True
        )
        # The own rows' whole backward while the output gradients travel.
        grad_own = grad_ND[n_send:n_kept]
        grad_w2 = _w2_grad(grad_own, own_saved, route.offs_own) if need[3] else None
        own_grad_gate, own_grad_up = _gate_up_grads(
            grad_own, own_saved, weights[1], route.offs_own, product_dead=True
        )
        grad_x_own = _x_grad(own_grad_gate, own_grad_up, weights, route.offs_own)
        grad_w1, grad_w3 = _w13_grads(
            x_own_RD, own_grad_gate, own_grad_up, route.offs_own, need_w13
        )
        del x_own_RD
        recv_saved = _swiglu_saved(routed_RD, hidden[2:], weights, route.offs_recv)
        work.wait()
        grad_RD = grad_recv_MD.index_select(0, token_M)
        grad_gate, grad_up = _gate_up_grads(grad_RD, recv_saved, weights[1], route.offs_recv)
        grad_x_RD = _x_grad(grad_gate, grad_up, weights, route.offs_recv)
        grad_sent_ND = grad_ND  # dead since the wait: reused, as in the forward
        work = dist.all_to_all_single(
            grad_sent_ND[:n_send],
            torch.index_select(grad_x_RD, 0, row_M, out=grad_recv_MD),
            route.send,
            route.recv,
            group=route.group,
            async_op=True,
        )
        if grad_w2 is not None:
            grad_w2.add_(_w2_grad(grad_RD, recv_saved, route.offs_recv))
        recv_w1, recv_w3 = _w13_grads(routed_RD, grad_gate, grad_up, route.offs_recv, need_w13)
        for grad_w, recv_w in ((grad_w1, recv_w1), (grad_w3, recv_w3)):
            if grad_w is not None:
                grad_w.add_(recv_w)
        grad_sent_ND[n_send:n_kept].copy_(grad_x_own)
        grad_sent_ND[n_kept:].zero_()  # dropped pairs: no gradient to their tokens
        work.wait()
        grad_x_TD = sum_rows(grad_sent_ND, row_TX)
        return (grad_x_TD, grad_scores_TX, grad_w1, grad_w2, grad_w3, *(None,) * 7)


# Note [Ranks with identical tokens]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Expert parallelism assumes that the ranks of its mesh route different tokens: each expert
# sums the gradients of the rows it receives, and the result is labelled the complete
# gradient. Ranks that route the same tokens (for example the tp ranks of a block, with the
# plan applied without PrepareMoEInput) still give correct outputs, but expert gradients too
# large by the number of such ranks, silently. So a dispatcher all-gathers a checksum of each
# rank's tokens (token count and a position-weighted float64 sum) once, on its first forward
# with gradients enabled, and on every forward under TORCH_DISTRIBUTED_DEBUG=DETAIL; every
# rank sees the same gathered values and so raises the same ValueError, before any exchange.
# Forwards without gradients (evaluation, which may well give every rank the same batch) are
# not checked. The verdict lives on the dispatcher (``tokens_checked``).


# Note [Expert parallelism under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exchange sizes of an all-to-all are data: they must be read on the host, and traced code
# would specialise on them and recompile at nearly every step. So while ``torch.compile``
# traces a layer, ``run_experts`` of a dispatcher with a mesh (dispatch, the expert math and
# combine) runs eagerly, as one island: the graph breaks around it, and only around it. An MoE
# layer enters the island one level up, calling its whole experts module eagerly (Note [Eager
# islands under torch.compile] in ``moe/layer.py``: one break instead of one per frame). The
# island runs exactly the eager code (the one-node fast path included), so compiled and eager
# results are identical; the router, the shared experts and everything around the layer are
# compiled. torchtitan keeps its EP all-to-all out of the graph the same way.
_EAGER_REASON = (
    "dtensor_moe runs expert-parallel dispatch, experts and combine eagerly under torch.compile: "
    "the all-to-all exchange sizes are read on the host (Note [Expert parallelism under "
    "torch.compile] in dtensor_moe/parallel/dispatch.py); compile with fullgraph=False"
)


_token_check = torch.compiler.disable(
    lambda dispatcher, x_TD, capacity: dispatcher._token_check(x_TD, capacity),
    reason="dtensor_moe checks once, eagerly, that the ranks of an expert-parallel mesh route "
    "different tokens (Note [Ranks with identical tokens] in dtensor_moe/parallel/dispatch.py)",
)


def _check_equal_capacity(capacities: list[int], mesh: DeviceMesh, ranks: tuple[int, ...]) -> None:
    """Note [Static exchange at capacity]: the ranks of ``mesh`` must agree on the capacity
    (``-1``: not padded to capacity); ``capacities`` is the all-gathered list, the same on every
    rank, so every rank raises alike."""
    if len(set(capacities)) <= 1:
        return
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, capacities, strict=True))
    raise ValueError(
        f"pad_to_capacity under expert parallelism over {mesh} needs the same expert capacity "
        f"on every rank, got {per_rank} (-1: no pad_to_capacity). A capacity_factor's capacity "
        "follows the number of tokens a forward routes, so give every rank the same batch "
        "shape (B, L), or set a fixed capacity_per_expert instead (the same on every rank "
        "for any batch), or set pad_to_capacity=False (the exchange then reads its sizes on "
        "the host)"
    )


def _eager_run_experts(dispatcher, experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E,
                       capacity=None):
    y_TD = dispatcher.run_experts(experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
    # A DTensor leaving the island would reach AOT autograd as an output whose tangent it
    # cannot match; the Partial wrapper (expert TP with gathered tokens) is re-made outside.
    return y_TD.to_local() if isinstance(y_TD, DTensor) else y_TD


_eager_run_experts = torch.compiler.disable(_eager_run_experts, reason=_EAGER_REASON)


# Note [Static exchange at capacity]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``pad_to_capacity`` (Note [Expert capacity] in ``dtensor_moe/moe/capacity.py``) every
# destination ``q * e + j`` gets exactly ``C`` rows, its kept pairs followed by zero rows. So
# every rank sends ``e * C`` rows to every rank and receives as many: the exchange sizes are
# known before the step, and the dispatch needs neither the count exchange nor a host read (the
# sync-free path). The received rows are ``(P, e, C)`` blocks (source rank, local expert,
# slot); a transpose groups them by local expert, ``P * C`` rows each, and combine undoes it
# before the exchange back. Collectives: forward ``all_to_all_single`` x 2 (tokens, outputs),
# backward x 2. It needs the same ``C`` on every rank of the mesh: with ``capacity_factor``,
# the same batch shape (checked with the identical-tokens check, Note [Ranks with identical
# tokens]); ``capacity_per_expert`` fixes ``C`` for every batch, so batches may differ.


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
        overlap: run dispatch, experts and combine as the one-node overlapped step
            (Note [Overlapped all-to-all], default) where it applies; ``False``: always the
            plain ``dispatch`` -> ``compute`` -> ``combine`` path with functional collectives.
            Both give the same results (the parity tests run both); ``True`` is faster.

    Forward: ``all_to_all_single`` x 3 on ``mesh`` (counts, tokens, outputs); backward:
    ``all_to_all_single`` x 2. No collective when ``mesh`` is ``None``. The first forward with
    gradients enabled (every one under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) adds one
    ``all_gather`` that checks that the ranks route different tokens (Note [Ranks with
    identical tokens]).
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
        overlap: bool = True,
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
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.mesh = mesh
        self.overlap = overlap
        self.replicas = replicas
        self.partial_mesh = partial_mesh
        # Note [Ranks of a mesh, read once]
        self.ranks: tuple[int, ...] = () if mesh is None else mesh_ranks(mesh)
        self.partial_ranks: tuple[int, ...] = (
            () if partial_mesh is None else mesh_ranks(partial_mesh)
        )
        self.rank: int = 0 if mesh is None else local_rank(mesh)
        # Note [Ranks with identical tokens]: set once the first forward's check has passed.
        self.tokens_checked = False
        # Sort key of each destination id ``q * e + j``: rank ``q``'s position in the send
        # order (this rank last, Note [Overlapped all-to-all]), then ``j``.
        self._send_key: tuple[int, ...] = ()
        if mesh is not None:
            me, e = self.rank, num_experts // self.ep_size
            position = [*range(me), *range(me + 1, size), me]
            rank_position = [position.index(q) for q in range(size)]
            self._send_key = tuple(rank_position[g // e] * e + g % e for g in range(size * e))

    @property
    def ep_size(self) -> int:
        """Ranks that hold different experts: the mesh size over ``replicas``."""
        return 1 if self.mesh is None else self.mesh.size() // self.replicas

    def _check_distinct_tokens(self, x_TD: torch.Tensor, capacity: Capacity | None = None) -> None:
        """Note [Ranks with identical tokens]: raise on every rank if two ranks of the mesh
        route the same tokens (or, with ``pad_to_capacity``, have different capacities: Note
        [Static exchange at capacity]). Runs on the first forward with gradients enabled, and
        on every one under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: one all-gather of three
        numbers.

        Under ``torch.compile`` (the static exchange at capacity traces) the check runs eagerly:
        a graph break on the first forward only; the flag it sets then recompiles it away.
        Compiled code does not read the debug level (no check per forward under DETAIL)."""
        compiling = torch.compiler.is_compiling()
        detail = not compiling and dist.get_debug_level() == dist.DebugLevel.DETAIL
        if (self.tokens_checked and not detail) or not torch.is_grad_enabled():
            return
        _token_check(self, x_TD, capacity)

    def _token_check(self, x_TD: torch.Tensor, capacity: Capacity | None) -> None:
        """The check of :meth:`_check_distinct_tokens`, once it is due."""
        x = x_TD.detach().reshape(-1).to(torch.float64)
        # A position-weighted sum: equal for identical tokens, distinct otherwise but by a
        # coincidence of measure zero. Ranks without tokens, or with all-zero tokens, prove
        # nothing and are left out.
        weights = torch.cos(torch.arange(x.numel(), device=x.device, dtype=torch.float64))
        static_c = capacity.per_expert if capacity is not None and capacity.padded else -1
        mine = torch.tensor([float(x_TD.shape[0]), 0.0, float(static_c)], dtype=torch.float64,
                            device=x.device)
        mine[1] = (x * weights).sum()
        gathered = funcol.all_gather_single(mine, 0, self.mesh).view(-1, 3).tolist()
        _check_equal_capacity([int(c) for _, _, c in gathered], self.mesh, self.ranks)
        seen: dict[tuple[float, float], int] = {}
        for position, (tokens, checksum, _) in enumerate(gathered):
            if tokens == 0 or checksum == 0:
                continue
            first = seen.setdefault((tokens, checksum), position)
            if first != position:
                raise ValueError(
                    f"expert parallelism over {self.mesh}: ranks {self.ranks[first]} and "
                    f"{self.ranks[position]} route identical tokens ({int(tokens)} rows), so "
                    "their expert gradients would be summed as if they were different data "
                    "(too large by the number of such ranks). If they are the tp ranks of a "
                    "tensor-parallel block, apply PrepareMoEInput(routing='split') to the MoE "
                    "(parallelize_moe does), so that each routes its own share of the "
                    "tokens; otherwise give the ranks different data"
                )
        self.tokens_checked = True

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Send each (token, expert) row to the ranks holding the expert; see the module Note.

        With a ``capacity`` (Note [Expert capacity] in ``dtensor_moe/moe/capacity.py``), the
        dropped pairs are not sent; with ``pad_to_capacity`` the exchange is static (Note
        [Static exchange at capacity])."""
        if self.mesh is None:
            return super().dispatch(x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        self._check_distinct_tokens(x_TD, capacity)
        ids_TX, scores_TX, counts_X = self._destinations(topk_scores_TK, topk_ids_TK, counts_E)
        if capacity is not None and capacity.padded:
            return self._dispatch_static(x_TD, ids_TX, scores_TX, counts_X, capacity)
        P, e = self.mesh.size(), self.num_experts // self.ep_size
        # The count exchange runs while this rank sorts and gathers its rows.
        counts_in = funcol.all_to_all_single(counts_X, None, None, self.mesh)
        # the send side is never padded; dropped pairs are left out (Note [The void row])
        send_capacity = None if capacity is None else Capacity(per_expert=0, padded=False)
        layout = sort_by_expert(ids_TX, counts_X, capacity=send_capacity)
        sent_ND, scores_TX = self._send_rows(x_TD, scores_TX, layout)
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
            void_row=layout.void_row,
            order_N=layout.order_N if layout.row_N is None else None,
            input_splits=tuple(input_splits),
            output_splits=tuple(output_splits),
            received_row_M1=local.row_TK,
        )
        return permute_tokens(received_MD, local), local.counts_e, metadata

    def _send_rows(
        self, x_TD: torch.Tensor, scores_TX: torch.Tensor, layout: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows to send in ``layout``'s order, scaled by their score with
        ``score_before_experts`` (then the combine weights are ``None``)."""
        sent_ND = permute_tokens(x_TD, layout)
        if not self.score_before_experts:
            return sent_ND, scores_TX
        return sent_ND * scores_in_rows(scores_TX, layout).unsqueeze(-1), None

    def _dispatch_static(
        self,
        x_TD: torch.Tensor,
        ids_TX: torch.Tensor,
        scores_TX: torch.Tensor,
        counts_X: torch.Tensor,
        capacity: Capacity,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMetadata]:
        """Note [Static exchange at capacity]: ``C`` rows per destination expert, equal
        splits, no count exchange and no host read."""
        P, e, C = self.mesh.size(), self.num_experts // self.ep_size, capacity.per_expert
        layout = sort_by_expert(ids_TX, counts_X, capacity=capacity)
        sent_ND, scores_TX = self._send_rows(x_TD, scores_TX, layout)
        splits = [e * C] * P
        received_MD = funcol.all_to_all_single_autograd(sent_ND, splits, splits, self.mesh)
        routed_RD = received_MD.view(P, e, C, -1).transpose(0, 1).reshape(P * e * C, -1)
        metadata = AllToAllMetadata(
            row_TK=layout.row_TK,
            scores_TK=scores_TX,
            void_row=True,
            input_splits=tuple(splits),
            output_splits=tuple(splits),
            received_row_M1=None,
        )
        counts_e = torch.full((e,), P * C, dtype=torch.int64, device=x_TD.device)
        return routed_RD, counts_e, metadata

    def run_experts(
        self,
        experts: Any,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> torch.Tensor:
        """Dispatch, expert math and combine, with both exchanges overlapped with local rows.

        See Note [Overlapped all-to-all]. Falls back to ``dispatch`` / ``compute`` /
        ``combine`` without a mesh, with ``overlap=False``, with ``pad_multiple > 1``, with
        ``score_before_experts``, with ``pad_to_capacity`` (the static exchange of Note [Static
        exchange at capacity]), and when the experts do not run on the ``grouped_mm`` path. A
        capacity without padding runs here: the dropped pairs sort after every kept one and
        are neither sent nor computed (Note [The void row]).
        """
        static = capacity is not None and capacity.padded
        if (
            self.mesh is not None
            and torch.compiler.is_compiling()
            and self.runs_eagerly_under_compile(capacity)
        ):
            # Note [Expert parallelism under torch.compile]; an MoE layer runs its experts'
            # whole call eagerly before reaching here (Note [Eager islands under torch.compile])
            y_TD = _eager_run_experts(
                self, experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity
            )
            return self._finish(y_TD)
        plain = (
            self.mesh is None
            or static
            or not self.overlap
            or self.pad_multiple != 1
            or self.score_before_experts
            or experts.compute_path not in ("auto", "grouped_mm")
        )
        weights = None if plain else experts.local_weights()
        if weights is None or not _grouped_mm_supported(x_TD, weights[0]):
            return super().run_experts(
                experts, x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity
            )
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        self._check_distinct_tokens(x_TD, capacity)
        ids_TX, scores_TX, counts_X = self._destinations(topk_scores_TK, topk_ids_TK, counts_E)
        G = len(self._send_key)
        if capacity is not None:
            # Dropped pairs (expert id E) get destination G, whose key sorts after every kept
            # pair's (Note [The void row] in dtensor_moe/moe/dispatch.py).
            ids_TX = ids_TX.clamp(max=G)
        key_G = torch.tensor((*self._send_key, G), device=ids_TX.device)
        e = self.num_experts // self.ep_size
        y_TD = _ExpertParallelStep.apply(
            x_TD, scores_TX, *weights, ids_TX, counts_X,
            self.mesh.get_group(), key_G, e, self.rank,
            getattr(experts, "recompute_experts", False),
        )
        return self._finish(y_TD)

    def runs_eagerly_under_compile(self, capacity: Capacity | None = None) -> bool:
        """With a mesh, also every exchange but the static one at capacity: its sizes are read
        on the host (Note [Expert parallelism under torch.compile])."""
        if self.mesh is not None and not (capacity is not None and capacity.padded):
            return True
        return super().runs_eagerly_under_compile(capacity)

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

    def _finish(self, y_TD: torch.Tensor) -> torch.Tensor:
        if self.partial_mesh is None:
            return y_TD
        return DTensor.from_local(y_TD, self.partial_mesh, [Partial()], run_check=False)

    def combine(self, out_RD: torch.Tensor, metadata: DispatchMetadata) -> torch.Tensor:
        """Send expert outputs back and reduce each token's rows (``y_TD``)."""
        if self.mesh is None:
            y_TD = super().combine(out_RD, metadata)
        else:
            if not isinstance(metadata, AllToAllMetadata):  # before the exchange, every rank
                raise TypeError(
                    f"AllToAllTokenDispatcher.combine needs the AllToAllMetadata that this "
                    f"dispatcher's dispatch returned, got {type(metadata).__name__}; pass the "
                    "metadata of the matching dispatch call (not that of another dispatcher)"
                )
            if metadata.received_row_M1 is None:  # Note [Static exchange at capacity]
                P, e = self.mesh.size(), self.num_experts // self.ep_size
                received_MD = out_RD.view(e, P, -1, out_RD.shape[-1]).transpose(0, 1)
                received_MD = received_MD.reshape(out_RD.shape)
            else:
                received_MD = unpermute_and_reduce(out_RD, metadata.received_row_M1, None)
            returned_ND = funcol.all_to_all_single_autograd(
                received_MD,
                list(metadata.input_splits),
                list(metadata.output_splits),
                self.mesh,
            )
            y_TD = unpermute_and_reduce(
                returned_ND,
                metadata.row_TK,
                metadata.scores_TK,
                order_N=metadata.order_N,
                void_row=metadata.void_row,
            )
        return self._finish(y_TD)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"replicas={self.replicas}, partial={self.partial_mesh is not None}, "
            f"pad_multiple={self.pad_multiple}, score_before_experts={self.score_before_experts}, "
            f"overlap={self.overlap})"
        )
