"""The router losses of one forward: the balance loss (sequence or global batch) and the z-loss.

Shape legend:
    T  tokens routed by this rank        E  routed experts        K  experts per token
    B  sequences of the data shard       L  tokens per sequence   N  tokens of a token set

Note [Router loss shares]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every router loss is a sum over tokens times constants (selection counts, token counts) that do
not carry gradient. So a rank that routes a subset of a data shard's tokens can compute the
*share* of the loss that its tokens carry, given the shard's constants, and the shares add up to
the loss of the shard; so do their gradients (the router gate's ``Partial`` gradient sums them).
One forward therefore needs at most one all-reduce, of the constants (and of detached sums, for
the logged whole values), never of anything with gradient.

* **Balance loss, ``aux_loss_type="sequence"``** (DeepSeek-V3): per sequence
  ``f_be = E / (K * L) * hits_be``, ``P_be = sums_be / L``; the loss is
  ``coeff * mean_b sum_e f_be * P_be``. A rank's share uses the shard's ``hits_BE`` and its own
  score sums (:func:`~dtensor_moe.moe.router.aux_loss_from_sums`).
* **Balance loss, ``aux_loss_type="global_batch"``**: ``f_e = hits_e / (K * N)`` and
  ``P_e = sums_e / N`` over the ``N`` tokens of the whole global batch; the loss is
  ``coeff * E * sum_e f_e * P_e``. The hits and ``N`` are summed over the router's
  ``aux_loss_group`` (see :func:`~dtensor_moe.moe.balance.set_aux_loss_group`); without one,
  the "global batch" is this data shard. A rank's share is
  ``coeff * E / (K * N_shard * N) * sum_e hits_e * own_sums_e``: summed over the tp ranks of a
  shard and averaged over the data shards (what data-parallel gradient averaging does), it is
  the global-batch loss when the shards have equal size, and so is its gradient.
* **z-loss** (``z_loss_coeff``): ``coeff * mean_t logsumexp(logits_t)^2`` over the shard's
  ``N_shard = B * L`` tokens. A rank's share is ``coeff * sum_{own t} lse_t^2 / N_shard``:
  the global token count, not the local one.

"Own tokens": under ``"split"`` token parallelism a rank's routed tokens; under ``"replicate"``
(every tp rank routes every token) only its ``1/tp`` flat slice, so that each token's share is
carried once. The logged values ``router.last_aux_loss`` and ``router.last_z_loss`` are whole
losses (of the shard, or of the global batch for the global balance loss), never shares.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol

if TYPE_CHECKING:
    from dtensor_moe.moe.protocol import Router

__all__ = [
    "LossTokens",
    "aux_loss_from_sums",
    "global_aux_loss_from_sums",
    "logsumexp_squared",
    "router_losses",
    "sequence_sums",
    "z_loss",
    "z_loss_from_sum",
]


def sequence_sums(
    aux_scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    sequence_T: torch.Tensor,
    num_sequences: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence statistics of the auxiliary loss over the given tokens.

    Args:
        aux_scores_TE: per-token normalised scores (see :func:`sequence_aux_loss`).
        topk_ids_TK: selected experts of each token.
        sequence_T: index in ``[0, B)`` of the sequence each token belongs to (int64).
        num_sequences: ``B``.

    Returns:
        ``(hits_BE, sums_BE)``: counts of (token, expert) selections per sequence (a constant)
        and the differentiable sums of the scores per sequence, both as one matmul with the
        token-to-sequence membership (deterministic, no scatter-add). Both are sums over tokens,
        so statistics of disjoint token sets add up: a parallel layer sums them over the ranks
        that split the tokens of a sequence.
    """
    member_TB = (
        sequence_T.unsqueeze(1) == torch.arange(num_sequences, device=sequence_T.device)
    ).to(aux_scores_TE.dtype)
    selected_TE = torch.zeros_like(aux_scores_TE, dtype=member_TB.dtype).scatter_(
        1, topk_ids_TK, 1.0
    )
    hits_BE = member_TB.T @ selected_TE
    sums_BE = member_TB.T @ aux_scores_TE
    return hits_BE, sums_BE


def aux_loss_from_sums(
    hits_BE: torch.Tensor, sums_BE: torch.Tensor, *, seq_len: int, top_k: int, coeff: float
) -> torch.Tensor:
    """``coeff * mean_b sum_e f_be * P_be`` from per-sequence sums (DeepSeek-V3 style).

    ``f_be = E / (K * L) * hits_be`` is a constant and ``P_be = sums_be / L``; the loss is
    linear in ``sums_BE``, so the loss of a token subset with the *global* ``hits_BE`` is that
    subset's share of the loss, and the shares add up to the loss. This is the one formula of
    the loss; see :func:`sequence_sums`.
    """
    B, E = sums_BE.shape
    if B * seq_len == 0:
        return sums_BE.sum() * 0.0
    scale = coeff * E / (top_k * seq_len * seq_len * B)
    return (hits_BE * sums_BE).sum() * scale


def global_aux_loss_from_sums(
    hits_E: torch.Tensor,
    sums_E: torch.Tensor,
    *,
    shard_tokens: int | torch.Tensor,
    global_tokens: int | torch.Tensor,
    top_k: int,
    coeff: float,
) -> torch.Tensor:
    """``coeff * E / (K * shard_tokens * global_tokens) * sum_e hits_e * sums_e``.

    With ``hits_E``/``sums_E`` of the whole global batch and ``shard_tokens == global_tokens ==
    N``, this is the global-batch balance loss ``coeff * E * sum_e f_e * P_e`` with
    ``f_e = hits_e / (K * N)`` and ``P_e = sums_e / N``. With a rank's own ``sums_E`` and its
    shard's token count it is that rank's share (Note [Router loss shares]). Empty token sets
    give a zero that keeps the gradient graph.
    """
    E = hits_E.shape[-1]
    return _divide((hits_E * sums_E).sum() * (coeff * E / top_k), shard_tokens * global_tokens)


def logsumexp_squared(logits_TE: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits_t)^2`` of each token, in float32: the z-loss's per-token term."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square()


def z_loss_from_sum(
    sum_sq: torch.Tensor, *, num_tokens: int | torch.Tensor, coeff: float
) -> torch.Tensor:
    """``coeff * sum_sq / num_tokens`` (zero, with the graph, for zero tokens)."""
    return _divide(sum_sq * coeff, num_tokens)


def _divide(value: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """``value / count``, or ``value * 0`` (keeping the graph) when ``count`` is 0."""
    if isinstance(count, torch.Tensor):
        return value / count.clamp_min(1.0)
    return value / max(count, 1)


def z_loss(logits_TE: torch.Tensor, *, coeff: float) -> torch.Tensor:
    """The router z-loss ``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE), float32, 0-dim."""
    return z_loss_from_sum(
        logsumexp_squared(logits_TE).sum(), num_tokens=logits_TE.shape[0], coeff=coeff
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LossTokens:
    """Which tokens one router forward routes, for its losses (Note [Router loss shares]).

    Attributes:
        sequence_T: index in ``[0, B)`` of the sequence of each routed token (int64).
        num_sequences: ``B``, sequences of the data shard.
        seq_len: ``L``, tokens per sequence (global length under sequence parallelism).
        owned: the routed tokens whose share this rank carries; ``None``: all of them.
        shard_group: mesh or group over which the data shard's tokens are split between ranks
            (the tp mesh under ``"split"`` routing); ``None`` when this rank routes them all.
    """

    sequence_T: torch.Tensor
    num_sequences: int
    seq_len: int
    owned: slice | None = None
    shard_group: Any = None

    @classmethod
    def whole(cls, num_tokens: int, num_sequences: int, device: torch.device) -> LossTokens:
        """All ``B * L`` tokens of the shard, sequence by sequence (one process)."""
        L = num_tokens // num_sequences
        sequence_T = torch.div(
            torch.arange(num_tokens, device=device), max(L, 1), rounding_mode="floor"
        )
        return cls(sequence_T=sequence_T, num_sequences=num_sequences, seq_len=L)

    @property
    def shard_tokens(self) -> int:
        return self.num_sequences * self.seq_len


def router_losses(
    router: Router,
    logits_TE: torch.Tensor,
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    tokens: LossTokens,
) -> torch.Tensor | None:
    """This rank's share of the router losses (balance + z), summed; ``None`` when none is due.

    Due in training mode with ``aux_loss_coeff > 0`` or ``z_loss_coeff > 0`` in
    ``router.loss_settings`` (Note [Router protocol] in ``protocol.py``). The balance loss also
    reads ``router.aux_scores(scores_TE)`` (the per-token normalised scores) and, for
    ``"global_batch"``, ``router.aux_loss_group``. Sets the logged whole values
    ``router.last_aux_loss`` / ``router.last_z_loss``. ``K`` is ``topk_ids_TK.shape[-1]``.

    Collectives (forward only, no gradient): one ``all_reduce`` of the statistics when the
    tokens are split (``tokens.shard_group``) or a global-batch balance loss has a
    ``router.aux_loss_group``; none otherwise.
    """
    cfg = router.loss_settings
    want_aux, want_z = cfg.aux_loss_coeff > 0, cfg.z_loss_coeff > 0
    if not router.training or not (want_aux or want_z):
        return None
    own = tokens.owned if tokens.owned is not None else slice(None)
    is_global = cfg.aux_loss_type == "global_batch"
    group = router.aux_loss_group if is_global and want_aux else None
    group = group if group is not None else tokens.shard_group
    lse2_T = logsumexp_squared(logits_TE)
    aux_TE = router.aux_scores(scores_TE) if want_aux else None
    own_stats = _stats(aux_TE, topk_ids_TK, lse2_T, tokens, own, is_global=is_global)
    if group is not None:
        total = _all_reduce(own_stats, group)
    elif tokens.owned is None:
        total = own_stats
    else:  # "replicate": every token of the shard is here
        total = _stats(aux_TE, topk_ids_TK, lse2_T, tokens, slice(None), is_global=is_global)
    losses = []
    if want_aux:
        top_k = topk_ids_TK.shape[-1]
        losses.append(
            _balance(router, own_stats, total, tokens, top_k=top_k, is_global=is_global)
        )
    if want_z:
        z_kwargs = dict(coeff=cfg.z_loss_coeff)
        router.last_z_loss = z_loss_from_sum(
            total.z_sum.detach(), num_tokens=total.num_tokens, **z_kwargs
        )
        losses.append(z_loss_from_sum(own_stats.z_sum, num_tokens=tokens.shard_tokens, **z_kwargs))
    return losses[0] if len(losses) == 1 else losses[0] + losses[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Stats:
    """Sums over a token set: selections and scores (per sequence or global; ``None`` without
    a balance loss), squared logsumexps, and the token count (a float tensor or an int)."""

    hits: torch.Tensor | None
    sums: torch.Tensor | None
    z_sum: torch.Tensor
    num_tokens: Any


def _stats(
    aux_TE: torch.Tensor | None,
    topk_ids_TK: torch.Tensor,
    lse2_T: torch.Tensor,
    tokens: LossTokens,
    rows: slice,
    *,
    is_global: bool,
) -> _Stats:
    hits = sums = None
    if aux_TE is not None:
        B = 1 if is_global else tokens.num_sequences
        sequence_T = tokens.sequence_T[rows]
        if is_global:
            sequence_T = torch.zeros_like(sequence_T)
        hits, sums = sequence_sums(aux_TE[rows], topk_ids_TK[rows], sequence_T, B)
    z_sum = lse2_T[rows].sum()
    return _Stats(hits=hits, sums=sums, z_sum=z_sum, num_tokens=lse2_T[rows].shape[0])


def _all_reduce(own: _Stats, group: Any) -> _Stats:
    """The sums over every rank of ``group``: one ``all_reduce`` of one float32 vector."""
    z_sum = own.z_sum.detach().float()
    parts = [z_sum.reshape(1), torch.full_like(z_sum.reshape(1), float(own.num_tokens))]
    if own.hits is not None:
        parts += [own.hits.float().reshape(-1), own.sums.detach().float().reshape(-1)]
    total = funcol.all_reduce(torch.cat(parts), "sum", group)
    hits = sums = None
    if own.hits is not None:
        n = own.hits.numel()
        hits = total[2 : 2 + n].view_as(own.hits)
        sums = total[2 + n :].view_as(own.sums)
    return _Stats(hits=hits, sums=sums, z_sum=total[0], num_tokens=total[1])


def _balance(
    router: Router,
    own: _Stats,
    total: _Stats,
    tokens: LossTokens,
    *,
    top_k: int,
    is_global: bool,
) -> torch.Tensor:
    """This rank's share of the balance loss (``top_k`` experts per token); logs the whole loss
    in ``router.last_aux_loss``."""
    cfg = router.loss_settings
    if is_global:
        kwargs = dict(global_tokens=total.num_tokens, top_k=top_k, coeff=cfg.aux_loss_coeff)
        whole = global_aux_loss_from_sums(
            total.hits, total.sums.detach(), shard_tokens=total.num_tokens, **kwargs
        )
        share = global_aux_loss_from_sums(
            total.hits, own.sums, shard_tokens=tokens.shard_tokens, **kwargs
        )
    else:
        kwargs = dict(seq_len=tokens.seq_len, top_k=top_k, coeff=cfg.aux_loss_coeff)
        whole = aux_loss_from_sums(total.hits, total.sums.detach(), **kwargs)
        share = aux_loss_from_sums(total.hits, own.sums, **kwargs)
    router.last_aux_loss = whole.detach()
    return share
