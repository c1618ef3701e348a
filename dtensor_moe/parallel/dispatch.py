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
``[p * e, (p + 1) * e)``. The stages (Note [Dispatcher steps] in ``dtensor_moe/moe/dispatch.py``):

1. ``dispatch``: launch the count exchange (``all_to_all_single`` of the ``P * e``
   per-destination counts, equal splits), sort the rows by destination rank and local expert
   while it runs, wait, then start the exchange of the rows with their combine weights
   (Note [Packed rows]; variable splits read on the host, one sync).
2. ``receive``: wait for them and gather them, with their weights, into local-expert order
   (``sort_by_expert`` on ``(M, 1)`` local ids, with alignment padding, computed while they
   travelled).
3. ``send_back``: the expert outputs, already weighted, back in arrival order, start the
   reverse exchange.
4. ``combine``: wait, put the own rows' outputs after the returned ones, and sum each token's
   rows (``unpermute_and_reduce``, unweighted).

Every per-forward value lives in the returned ``Routed`` (frozen) or in local variables; the
dispatcher holds only its configuration.

Collectives, on the dispatcher's mesh, every rank the same, sizes agreeing by construction:
forward ``all_to_all_single`` x 3 (counts, then rows with their combine weights, then
outputs), backward x 2 (output gradients, then row and weight gradients). The
exchanges are start/wait pairs of autograd ops (Note [Exchanges as autograd pairs] in
``exchange.py``); ``CommDebugMode`` counts each ``all_to_all_single``.

Note [Packed rows]
~~~~~~~~~~~~~~~~~~
The experts apply the combine weights (``swiglu_down``), so each row travels with its weight:
``(N, D + 1)``, the weight as the last column, one all-to-all. ``permute_tokens`` gathers the
rows straight into that buffer (``extra_N``; the static exchange, whose layout has padding
rows, copies its gathered rows and the column into one, ``_with_column``), and its backward sums
the packed gradient whole and drops the column's sums. On arrival ``_InExpertOrder`` gathers
the rows and the weights from the buffer into local-expert order, and its backward writes
their gradients into one such buffer, so the reverse exchange is one all-to-all too. Sending
them as two tensors costs a second collective each way (gloo: a few ms of latency each on
CPU), for ``N`` numbers; packing the two gradients after the fact costs an ``M x D`` copy.

Note [Expert TP by all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With expert tensor parallelism on a 2-D ``(ep, etp)`` mesh, each of the ``etp`` ranks of an EP
group holds a hidden-dim slice of the same experts. Instead of gathering every token on every
``etp`` rank, the all-to-all runs over the flattened ``ep * etp`` ranks and sends each row to
all ``replicas = etp`` ranks that hold a slice of its expert: destination ``q = p * etp + j``
for EP rank ``p`` and slice ``j``. Each returns the partial output of its slice (weighted by
the row's score), and combine sums the ``etp`` partials of a row together with its ``K``
experts, in one pass. This is the same machinery with ``X = K * etp`` rows per token
(:func:`replicate_over_etp`), so the output is complete (not ``Partial``) and every tp rank
routes only its own tokens. The token gather's backward sums the ``X`` row gradients of a
token, which adds up the ``etp`` partial input gradients.

Note [Own rows]
~~~~~~~~~~~~~~~
The rows a rank routes to its own experts need no exchange. With ``overlap=True`` (the
default) and no alignment padding, the send order puts this rank's block last, the exchange
leaves it out, and ``GroupedExperts.forward`` computes it between the start and the wait of
the output exchange (``send_back`` ... ``combine``): the own rows' expert math runs while the
other outputs travel, and, by autograd's order, the own rows' backward runs while the output
gradients travel. With ``overlap=False`` or ``pad_multiple > 1`` every row goes through the
exchange (the own block to itself) and is computed after it. Both give the same results up to
float rounding; the parity tests run both.

With ``pad_to_capacity`` the exchange is static (Note [Static exchange at capacity]). A
capacity without padding drops pairs: they get destination ``G`` (one past every expert), sort
after the own rows, are neither sent nor computed, and their output rows are zero (Note [The
void row] in ``dtensor_moe/moe/dispatch.py``).
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

from dtensor_moe import _compat
from dtensor_moe.moe.capacity import Capacity
from dtensor_moe.moe.dispatch import (
    ExpertLayout,
    Received,
    Routed,
    TokenDispatcher,
    in_order,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    subset_layout,
    unpermute_and_reduce,
    unpermute_rows,
)
from dtensor_moe.parallel.exchange import (
    Exchange,
    gather_start,
    gather_wait,
    scatter_start,
    scatter_wait,
)
from dtensor_moe.parallel.mesh import local_rank, mesh_ranks

__all__ = ["AllToAllTokenDispatcher", "replicate_over_etp"]



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


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order``: ``_inverse(order)[order[i]] == i``."""
    return torch.empty_like(order).index_put_(
        (order,), torch.arange(order.numel(), device=order.device)
    )


class _InExpertOrder(torch.autograd.Function):
    """The received rows ``(R, D)`` and their combine weights ``(R,)`` in local-expert order
    (the received layout's buffer, padding rows zero), gathered from the ``(M, D + 1)`` buffer
    they travelled in (Note [Packed rows]); the backward writes both gradients into one such
    buffer, in arrival order, for one collective back."""

    @staticmethod
    def forward(ctx: Any, packed_MD1: torch.Tensor, layout: ExpertLayout) -> tuple:
        ctx.save_for_backward(layout.row_TK.reshape(-1))
        rows_MD, scores_M1 = packed_MD1[:, :-1], packed_MD1[:, -1:]
        return permute_tokens(rows_MD, layout), scores_in_rows(scores_M1, layout)

    @staticmethod
    def backward(ctx: Any, grad_RD: torch.Tensor, grad_R: torch.Tensor) -> tuple:
        (row_M,) = ctx.saved_tensors  # each arrival's row in expert order
        if torch.is_grad_enabled():  # create_graph: ops that record (out= records nothing)
            return torch.cat((grad_RD[row_M], grad_R[row_M, None]), -1), None
        packed_MD1 = grad_RD.new_empty(row_M.numel(), grad_RD.shape[1] + 1)
        torch.index_select(grad_RD, 0, row_M, out=packed_MD1[:, :-1])
        torch.index_select(grad_R, 0, row_M, out=packed_MD1[:, -1])
        return packed_MD1, None


def _with_column(t_ND: torch.Tensor, col_N: torch.Tensor) -> torch.Tensor:
    """``torch.cat((t_ND, col_N[:, None]), dim=-1)`` as two copies into one buffer: torch 2.13's
    CPU ``cat`` along the last dimension with a one-column piece takes about 5x as long."""
    out_ND1 = t_ND.new_empty(t_ND.shape[0], t_ND.shape[1] + 1)
    out_ND1[:, :-1] = t_ND
    out_ND1[:, -1] = col_N
    return out_ND1


def _block_sums(counts: list[int], e: int) -> list[int]:
    """Sums of consecutive blocks of ``e`` host counts: rows per rank of ``P * e`` counts."""
    return [sum(counts[i : i + e]) for i in range(0, len(counts), e)]


@dataclass(frozen=True, slots=True)
class _InFlight:
    """The exchanges of one expert-parallel forward (``Routed.exchange``).

    ``sending``: the buffers in flight of the rows and their combine weights (one exchange),
    and the exchange; ``received``: the received rows' grouping by local expert; ``back``:
    the splits of the way back (local rows and zero tail included); ``static``: the exchange at
    capacity (Note [Static exchange at capacity]).
    """

    sending: tuple[tuple[torch.Tensor, ...], Exchange]
    received: ExpertLayout
    back: Exchange


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
# not checked, nor the forward of torch's pipeline metadata inference (a ``PipelineStage``
# built without static metadata; the stages after the first run it on uninitialised buffers,
# which may be equal on every rank): every rank of the mesh is in that pass alike, and the
# check waits for the first real training forward. The verdict lives on the dispatcher
# (``tokens_checked``).


# Note [Expert parallelism under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exchange sizes of an all-to-all are data: they must be read on the host, and traced code
# would specialise on them and recompile at nearly every step. So while ``torch.compile``
# traces a layer, the stages of a dispatcher with a mesh (dispatch, the expert math and
# combine) runs eagerly, as one island: the graph breaks around it, and only around it. An MoE
# layer enters the island one level up, calling its whole experts module eagerly (Note [Eager
# islands under torch.compile] in ``moe/layer.py``: one break instead of one per frame). The
# island runs exactly the eager code (the own rows' overlap included), so compiled and eager
# results are identical; the router, the shared experts and everything around the layer are
# compiled. torchtitan keeps its EP all-to-all out of the graph the same way.
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
        overlap: compute the own rows without exchanging them, while the other rows'
            outputs travel (Note [Own rows], default) where it applies; ``False``: always the
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
        # order (this rank last, Note [Own rows]), then ``j``.
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
        if not compiling and _compat.in_pipeline_metadata_inference():
            return  # torch's shape pass: no training data (uninitialised buffers after stage 0)
        self._token_check(x_TD, capacity)

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
    ) -> Routed:
        """Sort the rows by destination and start sending them (Note [All-to-all dispatch]).

        With a ``capacity`` (Note [Expert capacity] in ``dtensor_moe/moe/capacity.py``), the
        dropped pairs are not sent; with ``pad_to_capacity`` the exchange is static (Note
        [Static exchange at capacity])."""
        if self.mesh is None:
            return super().dispatch(x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        self._check_distinct_tokens(x_TD, capacity)
        ids_TX, scores_TX, counts_X = self._destinations(topk_scores_TK, topk_ids_TK, counts_E)
        scores_TX = scores_TX.to(x_TD.dtype)
        if capacity is not None and capacity.padded:
            return self._dispatch_static(x_TD, ids_TX, scores_TX, counts_X, capacity)
        group, me, e = self.mesh.get_group(), self.rank, self.num_experts // self.ep_size
        counts_in = torch.empty_like(counts_X)
        counts_work = dist.all_to_all_single(counts_in, counts_X, group=group, async_op=True)
        # Sort by destination rank (this rank's own block last), then local expert, then token;
        # pairs dropped for capacity (id E) get key G and sort after every kept pair.
        G = len(self._send_key)
        keep_own = self.overlap and self.pad_multiple == 1  # Note [Own rows]
        if capacity is not None:
            ids_TX = ids_TX.clamp(max=G)
        send_key = self._send_key if keep_own else range(G)
        key_G = torch.tensor((*send_key, G), device=ids_TX.device)
        T, X = ids_TX.shape
        N = T * X
        order_N = torch.argsort(key_G[ids_TX.reshape(-1)], stable=True)
        token_N = torch.div(order_N, X, rounding_mode="floor")
        position_TX = _inverse(order_N).view(T, X)
        counts_work.wait()
        sent, arrived = torch.stack((counts_X, counts_in)).tolist()
        P = len(sent) // e
        send, recv = _block_sums(sent, e), _block_sums(arrived, e)
        own = sent[me * e : (me + 1) * e]
        if keep_own:
            send[me] = recv[me] = 0
        n_send, n_own = sum(send), (sum(own) if keep_own else 0)
        sent_rows = subset_layout(token_N, order_N, position_TX, 0, n_send, counts_X)
        sending = self._start_sending(x_TD, scores_TX, sent_rows, Exchange(group, send, recv))
        # While the rows travel: the received rows' order by local expert, the own rows.
        arrived_Pe = counts_in.view(P, e).clone()
        if keep_own:
            arrived_Pe[me] = 0
        local_ids_M = torch.repeat_interleave(
            torch.arange(e, device=counts_in.device).repeat(P), arrived_Pe.reshape(-1)
        )
        received = sort_by_expert(
            local_ids_M.unsqueeze(1), arrived_Pe.sum(0), pad_multiple=self.pad_multiple
        )
        own_counts = counts_X.new_tensor(own if keep_own else [0] * e)
        own_rows = subset_layout(token_N, order_N, position_TX, n_send, n_send + n_own, own_counts)
        back = Exchange(group, send, recv, n_local=n_own, n_tail=N - n_send - n_own)
        return Routed(
            source=x_TD,
            scores=scores_TX,
            layout=own_rows,
            row_TK=position_TX,
            order_N=order_N,
            exchange=_InFlight(sending=sending, received=received, back=back),
        )

    def _start_sending(
        self,
        x_TD: torch.Tensor,
        scores_TX: torch.Tensor,
        layout: ExpertLayout,
        ex: Exchange,
    ) -> tuple[tuple[torch.Tensor, ...], Exchange]:
        """Gather the rows of ``layout`` and start sending them with their combine weights, in
        one exchange node (or, with ``score_before_experts``, the rows scaled by them)."""
        scores_N = scores_in_rows(scores_TX, layout)
        if self.score_before_experts:  # the rows travel scaled; no weights to send
            rows_ND = permute_tokens(x_TD, layout) * scores_N.unsqueeze(-1)
            return (scatter_start(ex, rows_ND)[0],), ex
        # each row with its weight in one buffer: one collective each way (Note [Packed rows])
        if layout.row_N is None:  # gathered into it
            packed_ND1 = permute_tokens(x_TD, layout, scores_N)
        else:
            packed_ND1 = _with_column(permute_tokens(x_TD, layout), scores_N)
        return (scatter_start(ex, packed_ND1)[0],), ex

    def _dispatch_static(
        self,
        x_TD: torch.Tensor,
        ids_TX: torch.Tensor,
        scores_TX: torch.Tensor,
        counts_X: torch.Tensor,
        capacity: Capacity,
    ) -> Routed:
        """Note [Static exchange at capacity]: ``C`` rows per destination expert, equal
        splits (the own block included), no count exchange."""
        P, e, C = self.mesh.size(), self.num_experts // self.ep_size, capacity.per_expert
        layout = sort_by_expert(ids_TX, counts_X, capacity=capacity)
        splits = [e * C] * P
        sending = self._start_sending(
            x_TD, scores_TX, layout, Exchange(self.mesh.get_group(), splits, splits)
        )
        # The received (P, e, C) blocks, grouped by local expert: (e, P, C).
        dev = x_TD.device
        block_M = torch.arange(P * e * C, device=dev).view(P, e, C).transpose(0, 1).reshape(-1)
        received = ExpertLayout(
            token_N=block_M,
            order_N=block_M,
            row_N=None,
            row_TK=_inverse(block_M).view(-1, 1),
            counts_e=torch.full((e,), P * C, dtype=torch.int64, device=dev),
            num_rows=P * e * C,
        )
        nothing = subset_layout(  # every row goes through the exchange, the own ones too
            layout.token_N, layout.order_N, layout.row_TK, 0, 0,
            torch.zeros(e, dtype=torch.int64, device=dev),
        )  # fmt: skip
        return Routed(
            source=x_TD,
            scores=scores_TX,
            layout=nothing,
            row_TK=layout.row_TK,
            order_N=None,
            void_row=True,
            exchange=_InFlight(
                sending=sending,
                received=received,
                back=Exchange(self.mesh.get_group(), splits, splits),
            ),
        )

    def receive(self, routed: Routed) -> Received | None:
        """Wait for the rows and weights :meth:`dispatch` started sending."""
        ex = routed.exchange
        if ex is None:
            return None
        buffers, exchange = ex.sending
        (arrived,) = scatter_wait(exchange, *buffers)
        if self.score_before_experts:
            return Received(rows=arrived, scores=None, layout=ex.received)
        rows_RD, scores_R = _InExpertOrder.apply(arrived, ex.received)
        return Received(rows=rows_RD, scores=scores_R, layout=in_order(ex.received))

    def send_back(self, out_RD: torch.Tensor, routed: Routed) -> torch.Tensor | None:
        """Start returning the received rows' outputs, back in arrival order."""
        ex = routed.exchange
        if ex is None:
            return None
        out_MD = unpermute_rows(out_RD, ex.received)
        return gather_start(ex.back, out_MD)[0]

    def combine(
        self, local_RD: torch.Tensor, routed: Routed, returning: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Wait for the returned outputs, put the own rows' after them, and sum each token's
        rows (weighted already) into ``y_TD``."""
        ex = routed.exchange
        if ex is None and self.mesh is not None:  # before any exchange: the same on every rank
            raise TypeError(
                "AllToAllTokenDispatcher.combine needs the Routed that this dispatcher's "
                "dispatch returned (it carries the exchange), got one without an exchange; pass "
                "the Routed of the matching dispatch call (not that of another dispatcher)"
            )
        if ex is None:
            return self._finish(super().combine(local_RD, routed))
        if returning is None:
            raise ValueError(
                "AllToAllTokenDispatcher.combine needs what send_back returned for this "
                "forward's dispatch (every rank must call dispatch, receive, send_back and "
                "combine in that order)"
            )
        rows_ND = gather_wait(ex.back, returning, local_RD)[0]
        y_TD = unpermute_and_reduce(
            rows_ND, routed.row_TK, None, order_N=routed.order_N, void_row=routed.void_row
        )
        return self._finish(y_TD)

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """With a mesh, every exchange: its sizes are read on the host, or (the static
        exchange at capacity) it runs through the same eager exchange ops (Note [Expert
        parallelism under torch.compile])."""
        return self.mesh is not None or super().reads_host_sizes(capacity)

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

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"replicas={self.replicas}, partial={self.partial_mesh is not None}, "
            f"pad_multiple={self.pad_multiple}, score_before_experts={self.score_before_experts}, "
            f"overlap={self.overlap})"
        )
