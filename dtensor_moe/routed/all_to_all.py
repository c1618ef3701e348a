"""The all-to-all exchange: a count exchange, then variable-split all-to-alls of the rows.

Shape legend:
    T  tokens routed by this rank
    D  model width
    E  routed experts (global count); e  experts held by this rank (``E // ep``)
    K  experts per token; X = K * replicas rows per token (Note [Exchanges as autograd pairs]
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
count exchange), so the collectives match. ``CommDebugMode`` counts each one.

Note [Expert TP by all-to-all])
    N  rows this rank sends (including its own), sorted by destination rank, then local expert
    M  rows this rank receives from the other ranks, grouped by source rank, then local expert
    R  rows of a routed buffer grouped by local expert, alignment padding included
    P  ranks of the all-to-all mesh (``ep * replicas``)

Note [All-to-all dispatch]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Experts are ``Shard(0)`` over the EP ranks: EP rank ``p`` holds global experts
``[p * e, (p + 1) * e)``. The stages (Note [Dispatcher steps] in ``layouts.py``):

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
exchange holds only its configuration.

Collectives, on the exchange's mesh, every rank the same, sizes agreeing by construction:
forward ``all_to_all_single`` x 3 (counts, then rows with their combine weights, then
outputs), backward x 2 (output gradients, then row and weight gradients). The
exchanges are start/wait pairs of autograd ops (Note [Exchanges as autograd pairs] in
below); ``CommDebugMode`` counts each ``all_to_all_single``.

Note [Packed rows]
~~~~~~~~~~~~~~~~~~
The experts apply the combine weights (``swiglu_down``), so each row travels with its weight:
``(N, D + 1)``, the weight as the last column, one all-to-all. ``permute_tokens`` gathers the
rows straight into that buffer (``extra_N``; the static exchange, whose layout has padding
rows, copies its gathered rows and the column into one: ``pack_rows`` in ``layouts.py``), and its
backward sums
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
void row] in ``layouts.py``).
"""

# ruff: noqa: N803, N806, N815

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtensor_moe.routed.exchange import (
    FEATURES,
    Received,
    Routed,
    TokenExchange,
    announce_launch,
    register_exchange,
)
from dtensor_moe.routed.layouts import (
    Capacity,
    ExpertLayout,
    SortedPairs,
    in_order,
    pack_rows,
    permute_tokens,
    scores_in_rows,
    sort_by_expert,
    subset_layout,
    unpermute_and_reduce,
    unpermute_rows,
)

__all__ = ["AllToAllExchange", "destinations", "replicate_over_etp"]


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
    announce_launch()


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


def destinations(
    scores_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    experts_per_rank: int,
    replicas: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row destination ids ``q * e + j``, their scores and counts: the pairs themselves
    without expert TP, else each replicated over its ``replicas`` ranks (:func:`replicate_over_etp`,
    the scores alike)."""
    if replicas == 1:
        return topk_ids_TK, scores_TK, counts_E
    ids_TX, counts_X = replicate_over_etp(
        topk_ids_TK, counts_E, experts_per_rank=experts_per_rank, replicas=replicas
    )
    return ids_TX, scores_TK.repeat_interleave(replicas, dim=1), counts_X


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


# Note [Expert parallelism under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exchange sizes of an all-to-all are data: they must be read on the host, and traced code
# would specialise on them and recompile at nearly every step. So while ``torch.compile``
# traces a layer, the stages of an exchange with a mesh (dispatch, the expert math and
# combine) runs eagerly, as one island: the graph breaks around it, and only around it. An MoE
# layer enters the island one level up, calling its whole experts module eagerly (Note [Eager
# islands under torch.compile] in ``moe/layer.py``: one break instead of one per frame). The
# island runs exactly the eager code (the own rows' overlap included), so compiled and eager
# results are identical; the router, the shared experts and everything around the layer are
# compiled. torchtitan keeps its EP all-to-all out of the graph the same way.


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


@register_exchange
class AllToAllExchange(TokenExchange):
    """Expert-parallel dispatch and combine by all-to-all over a 1-D mesh; see Note [All-to-all
    dispatch]. Registered as ``"all_to_all"``: the default backend, with every feature.

    The ``mesh`` holds the ranks that receive rows, in the order of Note [Expert TP by
    all-to-all]: rank ``q`` holds experts ``[(q // replicas) * e, ...)`` (``e = E * replicas /
    P``) and hidden slice ``q % replicas``. ``overlap``: compute the own rows without exchanging
    them, while the other rows' outputs travel (Note [Own rows], default) where it applies.

    Forward: ``all_to_all_single`` x 3 on ``mesh`` (counts, tokens, outputs); backward:
    ``all_to_all_single`` x 2. The first forward with gradients enabled (every one under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) adds one ``all_gather`` that checks that the ranks
    route different tokens (Note [Ranks with identical tokens] in ``exchange.py``).
    """

    name = "all_to_all"
    hands_over_launches = True
    static_capacity = True
    features = FEATURES

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.mesh is None:
            raise ValueError(
                "the 'all_to_all' exchange needs a mesh of the ranks that exchange rows; use "
                "exchange='local' when every expert is on this rank"
            )
        # Sort key of each destination id ``q * e + j``: rank ``q``'s position in the send
        # order (this rank last, Note [Own rows]), then ``j``.
        size, me, e = self.mesh.size(), self.rank, self.experts_per_rank
        position = [*range(me), *range(me + 1, size), me]
        rank_position = [position.index(q) for q in range(size)]
        self._send_key = tuple(rank_position[g // e] * e + g % e for g in range(size * e))

    def sort_and_send(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None,
    ) -> Routed:
        """Sort the rows by destination and start sending them (Note [All-to-all dispatch]).

        With a ``capacity`` (Note [Expert capacity] in ``dtensor_moe/moe/capacity.py``), the
        dropped pairs are not sent; with ``pad_to_capacity`` the exchange is static (Note
        [Static exchange at capacity])."""
        ids_TX, scores_TX, counts_X = destinations(
            scores_TK, topk_ids_TK, counts_E, experts_per_rank=self.experts_per_rank,
            replicas=self.replicas,
        )  # fmt: skip
        if capacity is not None and capacity.padded:
            return self._dispatch_static(x_TD, ids_TX, scores_TX, counts_X, capacity)
        group, me, e = self.mesh.get_group(), self.rank, self.experts_per_rank
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
        rows = pack_rows(x_TD, scores_TX, layout, scaled=self.score_before_experts)
        return (scatter_start(ex, rows)[0],), ex

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
        P, e, C = self.mesh.size(), self.experts_per_rank, capacity.per_expert
        layout = sort_by_expert(ids_TX, counts_X, capacity=capacity)
        splits = [e * C] * P
        sending = self._start_sending(
            x_TD, scores_TX, layout, Exchange(self.mesh.get_group(), splits, splits)
        )
        # The received (P, e, C) blocks, grouped by local expert: (e, P, C).
        dev = ids_TX.device
        block_M = torch.arange(P * e * C, device=dev).view(P, e, C).transpose(0, 1).reshape(-1)
        received = SortedPairs(
            token_N=block_M,
            order_N=block_M,
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

    def receive(self, routed: Routed) -> Received:
        """Wait for the rows and weights :meth:`dispatch` started sending."""
        ex = routed.exchange
        buffers, exchange = ex.sending
        (arrived,) = scatter_wait(exchange, *buffers)
        if self.score_before_experts:
            return Received(rows=arrived, scores=None, layout=ex.received)
        rows_RD, scores_R = _InExpertOrder.apply(arrived, ex.received)
        return Received(rows=rows_RD, scores=scores_R, layout=in_order(ex.received))

    def send_back(self, out_RD: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Start returning the received rows' outputs, back in arrival order."""
        ex = routed.exchange
        out_MD = unpermute_rows(out_RD, ex.received)
        return gather_start(ex.back, out_MD)[0]

    def _combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any) -> torch.Tensor:
        """Wait for the returned outputs, put the own rows' after them, and sum each token's
        rows (weighted already) into ``y_TD``."""
        if not isinstance(routed.exchange, _InFlight):  # before any exchange: on every rank
            raise TypeError(
                "AllToAllExchange.combine needs the Routed that this exchange's dispatch "
                "returned (it carries the exchange), got one without an exchange; pass the "
                "Routed of the matching dispatch call (not that of another exchange)"
            )
        if returning is None:
            raise ValueError(
                "AllToAllExchange.combine needs what send_back returned for this forward's "
                "dispatch (every rank must call dispatch, receive, send_back and combine in "
                "that order)"
            )
        rows_ND = gather_wait(routed.exchange.back, returning, local_RD)[0]
        return unpermute_and_reduce(
            rows_ND, routed.row_TK, None, order_N=routed.order_N, void_row=routed.void_row
        )

    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """Always: its sizes are read on the host, or (the static exchange at capacity) it
        runs through the same eager exchange ops (Note [Expert parallelism under
        torch.compile])."""
        return True
