"""Token-choice top-k router with group-limited routing and load-balancing statistics.

Shape legend:
    T  tokens routed by this rank (``B * L`` flattened)
    D  model width (``MoEConfig.dim``)
    E  routed experts (global count)
    K  experts per token (``MoEConfig.top_k``)
    B  sequences in the batch, L tokens per sequence
    G  expert groups, S experts per group (``G * S == E``)
"""

# ruff: noqa: N803, N806, N812, N815

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe import _compat
from dtensor_moe.moe.capacity import Capacity, capacity_keep, expert_capacity, round_up
from dtensor_moe.moe.config import DeviceLike, MoEConfig, autocast_off, factory_kwargs
from dtensor_moe.moe.losses import (
    aux_loss_from_sums,
    router_losses,
    sequence_sums,
)
from dtensor_moe.moe.protocol import Router, RouterLossSettings, is_router
from dtensor_moe.moe.tokens import RoutedTokens

__all__ = [
    "BIAS_UPDATE_WARN_FORWARDS",
    "RouterGate",
    "RouterOutput",
    "TokenChoiceTopKRouter",
    "aux_loss_from_sums",
    "balanced_topk_ids",
    "expert_counts",
    "sequence_aux_loss",
    "sequence_sums",
    "set_router_loss_scale",
]

# aux_loss_from_sums and sequence_sums live in losses.py (Note [Router loss shares]); they stay
# importable from here.


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterOutput:
    """What one router forward hands to the routed experts' exchange.

    Attributes:
        topk_scores_TK: combine weights of the selected experts, in the input dtype.
        topk_ids_TK: selected expert ids (int64), in ``[0, E)``; ``E`` for a pair dropped for
            capacity (Note [Expert capacity] in ``capacity.py``).
        counts_E: tokens this forward sent to each expert (int64), all routed tokens: what
            the exchange sends (the kept pairs, with a capacity).
        count_E: the part of ``counts_E`` that this rank adds to ``tokens_per_expert``: the
            same, except under ``PrepareMoEInput(routing="replicate")``, where the tp ranks
            route the same tokens and each counts its own slice (Note [Global router
            statistics] in ``parallel/token_parallel.py``).
        aux_loss: the router losses of this forward, each already multiplied by its
            coefficient, summed: the balance loss (``aux_loss_coeff``) and the z-loss
            (``z_loss_coeff``); 0-dim float32, or ``None`` when both are disabled or not
            training. Under token parallelism it is this rank's share (Note [Router loss
            shares] in ``losses.py``). The layer hands it to
            :func:`~dtensor_moe.moe.balance.attach_aux_loss`, which collects or attaches it
            (Note [Auxiliary loss follows the loss] in ``balance.py``).
        capacity: the capacity of this forward, handed to the exchange; ``None`` (dropless)
            without a capacity (``capacity_factor`` or ``capacity_per_expert``).
        dropped_E: the pairs of ``count_E``'s tokens dropped for capacity, per expert (what
            this rank adds to ``dropped_per_expert``); ``None`` without a capacity.
    """

    topk_scores_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    counts_E: torch.Tensor
    count_E: torch.Tensor
    aux_loss: torch.Tensor | None
    capacity: Capacity | None = None
    dropped_E: torch.Tensor | None = None


def expert_counts(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens sent to each of the ``num_experts`` experts (int64, shape ``(E,)``).

    A ``scatter_add`` into ``E`` bins: the output shape never depends on the data, so
    ``torch.compile`` traces it without a graph break (``bincount``'s output length depends on
    the largest id, which dynamo cannot know). Integer sums: exact and deterministic.
    """
    ids_N = topk_ids_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    return counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))


def balanced_topk_ids(
    num_tokens: int, top_k: int, num_experts: int, device: torch.device | None = None
) -> torch.Tensor:
    """The expert ids of forced balanced routing (int64, shape ``(T, K)``): token ``t``'s
    ``k``-th expert is ``(t * K + k) % E`` (Note [Forced balanced routing]).

    Every expert gets ``T * K / E`` pairs when ``E`` divides ``T * K``; otherwise the first
    ``T * K % E`` experts get one more. A token's ``K`` ids are ``K`` consecutive integers
    modulo ``E``: distinct for ``K <= E``. Tensor ops only (no host read).
    """
    pairs_N = torch.arange(num_tokens * top_k, dtype=torch.int64, device=device)
    return pairs_N.remainder(num_experts).view(num_tokens, top_k)


# Note [Forced balanced routing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``MoEConfig.force_balanced_routing`` is a debug mode for benchmarks, as torchtitan's
# ``DEBUG_FORCE_LOAD_BALANCED``: it answers "how fast is a step, and does the model fit, when
# the load is perfectly balanced?". It changes the model's outputs; it is never for training.
# Only the selection changes (:meth:`TokenChoiceTopKRouter.select`); everything else of a
# forward runs as usual, so the step does the same work as a real one:
#
# * the ids are :func:`balanced_topk_ids` over the ``T`` tokens this rank routes, in its local
#   order. Every rank of a parallel layout routes its own tokens, so with ``E | T * K`` every
#   rank sends every expert ``T * K / E`` rows: every expert-parallel exchange is equal. Under
#   ``PrepareMoEInput(routing="replicate")`` every tp rank routes the same tokens and picks the
#   same ids;
# * the gate and the scores are computed as usual; the combine weights are the scores of the
#   forced experts (:meth:`TokenChoiceTopKRouter.combine_weights`: ``route_norm``,
#   ``route_scale``), so the gate receives gradients;
# * the expert bias and the group limit do not apply to the forced ids (a token's ``K``
#   consecutive ids may span more than ``num_limited_groups`` groups). ``tokens_per_expert``,
#   ``RouterOutput.counts_E`` and the capacity's drops are those of the forced ids, so
#   ``update_expert_bias`` sees equal counts and leaves the bias as it is when ``E | T * K``;
# * the balance loss and the z-loss are computed as usual, from the scores and the forced ids;
# * capacity applies as usual: with ``capacity_factor >= 1`` and ``E | T * K`` nothing drops.
#
# No host read and no graph break: :func:`balanced_topk_ids` is an ``arange`` and a remainder.


def _counts_below(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """:func:`expert_counts` that leaves out ids ``>= num_experts`` (pairs dropped for
    capacity, or the kept pairs when counting the dropped ones)."""
    ids_N = ids.reshape(-1).clamp(max=num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids_N.device)
    return counts.scatter_add_(0, ids_N, torch.ones_like(ids_N))[:num_experts]


_COUNT_REASON = (
    "dtensor_moe updates the router's tokens_per_expert counter eagerly, outside the graph, "
    "because only at run time is it known whether a forward is an activation-checkpoint "
    "recompute (which must not count twice). In training mode this is one graph break at the end "
    "of the MoE forward: compile with fullgraph=False (or run the forward in eval mode, which "
    "does not count)"
)


#: Training forwards a router with an expert bias counts before it warns that
#: :func:`~dtensor_moe.moe.update_expert_bias` has not run since (once per router).
BIAS_UPDATE_WARN_FORWARDS = 100


def count_unless_recompute(
    router: Router,
    counts_E: torch.Tensor,
    dropped_E: torch.Tensor | None = None,
) -> None:
    """``router.tokens_per_expert += counts_E`` (and ``router.dropped_per_expert +=
    dropped_E`` when given) unless this runs inside a backward pass (recompute) or torch's
    pipeline metadata inference (Note [Counting under pipeline metadata inference]). A router
    without ``tokens_per_expert`` counts nothing (Note [Router protocol] in ``protocol.py``).

    A router with an expert bias also counts the forwards since the last
    :func:`~dtensor_moe.moe.update_expert_bias`, and warns once when they reach
    :data:`BIAS_UPDATE_WARN_FORWARDS` (Note [Expert bias needs its update]). Run eagerly under
    ``torch.compile`` (one graph break); see ``_COUNT_REASON``.
    """
    if router.tokens_per_expert is None:
        return
    if _in_backward_pass() or _compat.in_pipeline_metadata_inference():
        return
    with torch.no_grad():
        router.tokens_per_expert.add_(counts_E)
        if router.dropped_per_expert is not None and dropped_E is not None:
            router.dropped_per_expert.add_(dropped_E)
    if router.expert_bias is not None:
        forwards = getattr(router, "forwards_since_bias_update", 0) + 1
        router.forwards_since_bias_update = forwards
        if forwards == BIAS_UPDATE_WARN_FORWARDS:
            warnings.warn(
                f"an MoE router with use_expert_bias=True has counted "
                f"{BIAS_UPDATE_WARN_FORWARDS} training forwards without update_expert_bias: its "
                "expert bias stays as it is while tokens_per_expert grows. Call "
                "dtensor_moe.moe.update_expert_bias(model, rate) once per optimizer step, for "
                "example optimizer.register_step_post_hook(lambda *_: "
                "update_expert_bias(model, 1e-3))",
                UserWarning,
                stacklevel=3,  # past torch.compiler.disable's wrapper, into dtensor_moe
            )


# Note [Expert bias needs its update]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``use_expert_bias=True`` balances only when ``update_expert_bias`` runs: forgetting it leaves
# the bias at its value (0 for a new layer) while ``tokens_per_expert`` grows, with no other
# sign. A biased router therefore counts the forwards whose tokens it counts (training mode,
# grad enabled or not; not eval mode, not an activation-checkpoint recompute) in the plain int
# ``forwards_since_bias_update``, which ``update_expert_bias`` sets back to 0, and warns once,
# at the ``BIAS_UPDATE_WARN_FORWARDS``-th. A training step runs one forward per micro-batch, so
# with ``n`` micro-batches per step the warning comes after ``BIAS_UPDATE_WARN_FORWARDS / n``
# steps. The count runs where the token counter is updated, eagerly (a graph break under
# ``torch.compile`` in training anyway).


# Note [Counting under pipeline metadata inference]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A ``torch.distributed.pipelining.PipelineStage`` built without ``input_args`` and
# ``output_args`` (torch's default) runs every stage's forward and backward once more before
# its first step, in training mode, to learn the shapes it sends: stage 0 on the first
# micro-batch, the others on uninitialised buffers. Those tokens are no training data, so the
# router does not count them (``tokens_per_expert``, ``dropped_per_expert`` and the forwards of
# Note [Expert bias needs its update]): :func:`dtensor_moe._compat.in_pipeline_metadata_inference`
# finds torch's inference methods on the Python stack, in the eager counter update (under
# ``torch.compile`` too). The layers still route those tokens: the outputs of the inference
# forward must be the real forward's (shapes, placements, what requires grad), and a
# recompute of that forward under activation checkpointing must save the same tensors, from
# a backward that may run on another thread than the one the frames are on. So the expert-
# parallel exchanges run in that pass too, on every rank of the stage alike. Shown by
# ``tests/test_pp_router_traps.py`` (counters and bias against one process).


count_unless_recompute = torch.compiler.disable(count_unless_recompute, reason=_COUNT_REASON)


def _in_backward_pass() -> bool:
    """Whether this code runs inside an autograd backward pass.

    Note [Counting under activation checkpointing]: ``torch.utils.checkpoint`` re-runs the
    forward inside the backward pass (both the reentrant and the non-reentrant variant). The
    router must not count those tokens a second time. ``torch._C._current_graph_task_id`` is
    ``-1`` outside a backward pass; torch's own checkpoint code relies on the same call.
    """
    return _compat.in_backward_pass()


def _limit_to_top_groups(
    select_TE: torch.Tensor, num_groups: int, num_limited: int
) -> torch.Tensor:
    """Mask (``-inf``) the experts outside each token's ``num_limited`` best groups.

    A group's score is the sum of its two best expert scores (one when a group has one expert):
    the best by ``max``, the second by ``amax`` with the best masked: the same values in the same
    order as ``topk(2).values.sum(-1)`` (``tests/test_moe_router.py``), in a fraction of its CPU
    time for wide groups (``benchmarks/combine.py``).
    """
    T, E = select_TE.shape
    select_TGS = select_TE.view(T, num_groups, E // num_groups)
    best_TG1, at_TG1 = select_TGS.max(dim=-1, keepdim=True)
    group_scores_TG = best_TG1.squeeze(-1)
    if E // num_groups > 1:
        second_TG = select_TGS.scatter(-1, at_TG1, float("-inf")).amax(dim=-1)
        group_scores_TG = group_scores_TG + second_TG
    top_groups_TL = group_scores_TG.topk(num_limited, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, top_groups_TL, True)
    return select_TGS.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


def sequence_aux_loss(
    scores_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    num_sequences: int,
    coeff: float,
) -> torch.Tensor:
    """Sequence-level balance loss ``coeff * mean_b sum_e f_be * P_be`` (DeepSeek-V3 style).

    ``f_be = E / (K * L) * (tokens of sequence b that selected e)`` is a constant;
    ``P_be`` is the mean over the sequence of the per-token normalised scores, so the gradient
    reaches the router through ``P`` only. ``scores_TE`` must already be normalised per token
    (softmax output, or sigmoid scores divided by their sum). Tokens are laid out sequence by
    sequence: ``T == num_sequences * L``.
    """
    T = scores_TE.shape[0]
    L = T // num_sequences
    sequence_T = torch.div(
        torch.arange(T, device=scores_TE.device), max(L, 1), rounding_mode="floor"
    )
    hits_BE, sums_BE = sequence_sums(scores_TE, topk_ids_TK, sequence_T, num_sequences)
    return aux_loss_from_sums(
        hits_BE, sums_BE, seq_len=L, top_k=topk_ids_TK.shape[-1], coeff=coeff
    )


# Note [Expert bias keeps its dtype]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``update_expert_bias`` moves the bias by ``rate`` (1e-3 in DeepSeek-V3) per step. In bf16, whose
# 8-bit mantissa spaces the values near 0.5 by about 0.004, such a step rounds away and balancing
# stalls without a sign. ``nn.Module.to(torch.bfloat16)`` (or ``.half()``, ``.bfloat16()``) casts
# every floating buffer, so the router overrides ``_apply``, the one method those casts, device
# moves and ``to_empty`` all run, as torch's RNN modules do for their own state: the bias follows
# the device change, and its dtype is never below float32 (float32 as built; float64 stays
# float64). When the cast would have lowered it, the bias keeps its values from before the cast
# rather than rounding through it; a bias that is already below float32 (a bf16 one loaded with
# ``load_state_dict(..., assign=True)``) is brought back to float32 by the next cast, and
# ``update_expert_bias`` warns about it until then. The router computes its scores in float32,
# and selection adds the bias to them. ``tests/test_moe_router.py`` checks the casts, the device
# moves (to ``meta``), ``to_empty``, and that a 1e-4 update survives a bf16 model.


class RouterGate(nn.Linear):
    """The router's gate: an ``nn.Linear`` without bias that computes in ``compute_dtype``.

    ``forward`` casts its input and its weight to ``compute_dtype`` (``MoEConfig.router_dtype``;
    ``None``: the weight's dtype when the forward runs) with ``torch.autocast`` off, so the
    logits have that dtype whatever the parameter's dtype and whatever autocast is on. The
    casts are autograd ops: the weight's gradient arrives in the weight's own dtype. The weight
    is read inside ``forward``, after the module's pre-hooks (an FSDP2 unit's all-gather and
    mixed-precision cast), and the module is an ``nn.Linear`` for parallel styles and state
    dicts. No collective.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        compute_dtype: torch.dtype | None = None,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        dtype = weight.dtype if self.compute_dtype is None else self.compute_dtype
        with autocast_off(x):
            return F.linear(x.to(dtype), weight.to(dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute_dtype={self.compute_dtype}"


def bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an ``expert_bias`` of ``dtype`` keeps: never below float32 (Note [Expert bias
    keeps its dtype])."""
    return torch.promote_types(dtype, torch.float32)


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts from a linear gate: the router that
    :class:`~dtensor_moe.moe.MoE` builds by default, one :class:`~dtensor_moe.moe.protocol.Router`
    (Note [Router protocol] in ``protocol.py``).

    Buffers:
        ``expert_bias`` (E, float32, persistent; only with ``use_expert_bias``): added to the
        scores for expert *selection* only, never to the combine weights.
        ``tokens_per_expert`` (E, int64, not persistent): tokens routed to each expert since
        the last :func:`~dtensor_moe.moe.update_expert_bias`, counted in training mode and not
        again during activation-checkpoint recompute.
        ``dropped_per_expert`` (E, int64, not persistent; only with a capacity): the
        part of ``tokens_per_expert`` that the experts dropped for capacity, counted alike.

    The gate is a :class:`RouterGate`: the logits are computed in ``MoEConfig.router_dtype``
    (``None``: the gate weight's dtype), with ``torch.autocast`` off; ``router_dtype=
    torch.float32`` routes in float32 in a bf16 model and under FSDP2 bf16 mixed precision, as
    DeepSeek-V3's router does. The scores are float32 (or the logits' dtype when wider).
    ``device`` and ``dtype`` (torch's factory arguments) place the gate and the buffers; the
    buffers keep their dtypes.

    Attributes:
        last_aux_loss: detached value of the last balance loss, for logging only (``None``
            before the first training forward or when the loss is disabled). Nothing reads it.
        last_z_loss: the same for the z-loss (``z_loss_coeff``).
        aux_loss_group: process group over which a ``"global_batch"`` balance loss sums its
            statistics (``None``: this rank's batch, or its tp group's under token
            parallelism). Configuration, set by
            :func:`~dtensor_moe.moe.balance.set_aux_loss_group`.
        aux_loss_scale: the weight that an attached router loss receives in backward (a float,
            or a 0-dim tensor; 1.0 as built; when a tensor's value is read: Note [Attached
            router losses under loss scaling]). Configuration, set by
            :func:`set_router_loss_scale`.
        stage_ranks: the global ranks of the pipeline stage that holds this router (every rank
            without pipeline parallelism), or ``None``. Recorded by
            :func:`parallelize_moe` from its meshes, and read by the
            helpers that take a process group (Note [A router knows its stage] in
            ``balance.py``).
        pp_rank: the index of that stage (``None`` with ``stage_ranks``).

    No collective runs in forward or backward, except the one forward ``all_reduce`` of a
    ``"global_batch"`` balance loss with an ``aux_loss_group``.
    """

    def __init__(
        self, config: MoEConfig, *, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        factory = factory_kwargs(device, dtype)
        device = factory["device"]
        self.config = config
        self.gate = RouterGate(
            config.dim, config.num_experts, compute_dtype=config.router_dtype, **factory
        )
        E = config.num_experts
        bias = None
        if config.use_expert_bias:
            bias = torch.zeros(E, dtype=torch.float32, device=device)
        self.register_buffer("expert_bias", bias, persistent=True)
        counts = torch.zeros(E, dtype=torch.int64, device=device)
        self.register_buffer("tokens_per_expert", counts, persistent=False)
        dropped = torch.zeros_like(counts) if config.has_capacity else None
        self.register_buffer("dropped_per_expert", dropped, persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.aux_loss_group: object | None = None
        self.aux_loss_scale: float | torch.Tensor = 1.0
        self.stage_ranks: tuple[int, ...] | None = None  # set by parallelize_moe
        self.pp_rank: int | None = None
        # training forwards counted since the last update_expert_bias (Note [Expert bias
        # needs its update]); a host int, like the counters' window, not state to save
        self.forwards_since_bias_update = 0
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        """``E``, the routed experts (``MoEConfig.num_experts``)."""
        return self.config.num_experts

    @property
    def loss_settings(self) -> RouterLossSettings:
        """The router losses of ``MoEConfig`` (Note [Router protocol] in ``protocol.py``)."""
        cfg = self.config
        return RouterLossSettings(
            aux_loss_coeff=cfg.aux_loss_coeff,
            aux_loss_type=cfg.aux_loss_type,
            z_loss_coeff=cfg.z_loss_coeff,
        )

    def reset_parameters(self) -> None:
        """Initialise the gate (normal, ``init_std``) and zero the expert bias and the counters,
        as construction does: after ``to_empty`` of a router built on the ``meta`` device
        nothing is left uninitialised."""
        nn.init.normal_(self.gate.weight, std=self.config.init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
        self.reset_counters()

    def forward(
        self,
        x_TD: torch.Tensor,
        *,
        num_sequences: int = 1,
        count: bool = True,
        tokens: RoutedTokens | None = None,
    ) -> RouterOutput:
        """Route ``x_TD``, whose ``T`` tokens are ``num_sequences`` sequences laid end to end.

        ``count=False`` leaves ``tokens_per_expert`` to the caller (the :class:`MoE` layer
        counts at the end of its forward, so that under ``torch.compile`` the update is one
        graph break at the end, not one in the middle of the graph); the caller adds
        ``RouterOutput.count_E``.

        ``tokens`` (given by the :class:`MoE` layer; Note [One forward] in ``tokens.py``)
        describes the tokens of a parallel layout: ``x_TD`` may then be a DTensor of any
        leading shape ``(..., D)``. The gate runs on it as a module, and the routing steps run
        on its local logits: :meth:`scores` -> :meth:`select` -> :meth:`combine_weights`, the
        counts, and the router losses (:func:`~dtensor_moe.moe.losses.router_losses`) on the
        tokens this rank routes.

        Collectives: none, except one forward ``all_reduce`` of the router-loss statistics when
        ``tokens`` splits a batch over ranks or a ``"global_batch"`` balance loss has an
        ``aux_loss_group``.
        """
        cfg = self.config
        if tokens is None:
            self._check_input(x_TD, num_sequences)
            tokens = RoutedTokens(
                num_sequences=num_sequences,
                seq_len=x_TD.shape[0] // num_sequences,
                local_shape=tuple(x_TD.shape),
            )
        logits = self.gate(x_TD)  # in MoEConfig.router_dtype (RouterGate)
        logits_TE = tokens.local(logits).reshape(-1, cfg.num_experts)
        scores_TE = self.scores(logits_TE)
        topk_ids_TK = self.select(scores_TE)
        topk_scores_TK = self.combine_weights(scores_TE, topk_ids_TK)
        counts_E = expert_counts(topk_ids_TK, cfg.num_experts)
        count_E = counts_E
        if tokens.owned is not None:
            count_E = expert_counts(topk_ids_TK[tokens.owned], cfg.num_experts)
        loss_tokens = tokens.loss_tokens(logits_TE.shape[0], logits_TE.device)
        aux_loss = router_losses(self, logits_TE, scores_TE, topk_ids_TK, loss_tokens)
        capacity = dropped_E = None
        if cfg.has_capacity:
            capacity, keep_TK = self.capacity_keep(topk_ids_TK, topk_scores_TK, counts_E, tokens)
            owned = slice(None) if tokens.owned is None else tokens.owned
            dropped_TK = topk_ids_TK[owned].masked_fill(keep_TK[owned], cfg.num_experts)
            dropped_E = _counts_below(dropped_TK, cfg.num_experts)
            topk_ids_TK = topk_ids_TK.masked_fill(~keep_TK, cfg.num_experts)
            counts_E = _counts_below(topk_ids_TK, cfg.num_experts)
        if count:
            self.count_tokens(count_E, dropped_E)
        return RouterOutput(
            topk_scores_TK=topk_scores_TK.to(x_TD.dtype),
            topk_ids_TK=topk_ids_TK,
            counts_E=counts_E,
            count_E=count_E,
            aux_loss=aux_loss,
            capacity=capacity,
            dropped_E=dropped_E,
        )

    def capacity_keep(
        self,
        topk_ids_TK: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        counts_E: torch.Tensor,
        tokens: RoutedTokens,
    ) -> tuple[Capacity, torch.Tensor]:
        """The capacity of this forward and which of this rank's pairs are kept (bool
        ``(T, K)``): the single-device rule on the whole batch (Note [Expert capacity] in
        ``capacity.py``). ``counts_E``: this rank's selected pairs per expert, which are the
        batch's when the rank routes the whole batch. One all-gather of the routing table on
        the tp mesh when the batch's tokens are split over it; none otherwise."""
        cfg = self.config
        multiple = cfg.pad_multiple if cfg.pad_to_capacity else 1
        if cfg.capacity_per_expert is not None:
            per_expert = round_up(cfg.capacity_per_expert, multiple)
        else:
            per_expert = expert_capacity(
                tokens.num_sequences * tokens.seq_len,
                top_k=cfg.top_k,
                num_experts=cfg.num_experts,
                factor=cfg.capacity_factor,
                multiple=multiple,
            )
        capacity = Capacity(per_expert=per_expert, padded=cfg.pad_to_capacity)
        ids_bK, scores_bK, mine = tokens.batch_table(topk_ids_TK, topk_scores_TK)
        if mine is not None:
            counts_E = expert_counts(ids_bK, cfg.num_experts)
        keep_bK = capacity_keep(
            ids_bK, scores_bK, counts_E, capacity=capacity.per_expert, policy=cfg.drop_policy
        )
        return capacity, keep_bK if mine is None else keep_bK.index_select(0, mine)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``softmax`` or ``sigmoid`` of the gate logits, in float32 (in the logits' dtype
        when it is wider)."""
        logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
        if self.config.score_func == "softmax":
            return F.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Expert ids of each token: top-k of the (biased, group-limited) detached scores;
        with ``force_balanced_routing``, :func:`balanced_topk_ids` instead (Note [Forced
        balanced routing])."""
        cfg = self.config
        if cfg.force_balanced_routing:
            return balanced_topk_ids(
                scores_TE.shape[0], cfg.top_k, cfg.num_experts, scores_TE.device
            )
        select_TE = scores_TE.detach()
        if self.expert_bias is not None:
            select_TE = select_TE + self.expert_bias
        if cfg.num_expert_groups is not None and cfg.num_limited_groups < cfg.num_expert_groups:
            select_TE = _limit_to_top_groups(
                select_TE, cfg.num_expert_groups, cfg.num_limited_groups
            )
        return select_TE.topk(cfg.top_k, dim=-1).indices

    def combine_weights(self, scores_TE: torch.Tensor, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """The unbiased scores of the selected experts, renormalised and scaled (float32)."""
        cfg = self.config
        topk_scores_TK = scores_TE.gather(-1, topk_ids_TK)
        if cfg.route_norm:
            topk_scores_TK = topk_scores_TK / (topk_scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_TK * cfg.route_scale

    def aux_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Per-token normalised scores for the auxiliary loss (sigmoid scores sum to 1)."""
        if self.config.score_func == "sigmoid":
            return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE

    def _apply(self, fn: Any, recurse: bool = True) -> TokenChoiceTopKRouter:
        """``nn.Module._apply`` (what ``.to``, ``.cuda``, ``.bfloat16``, ``.to_empty`` run),
        except that ``expert_bias`` never drops below float32 and keeps its unrounded values:
        Note [Expert bias keeps its dtype]."""
        bias = self.expert_bias
        out = super()._apply(fn, recurse)
        moved = self.expert_bias
        if bias is None or moved is None or not moved.is_floating_point():
            return out
        keep = bias_dtype(bias.dtype)
        if moved.dtype != keep:
            # The values before the cast, where the cast put them (from meta, as after
            # to_empty, there are no values to keep).
            source = moved if bias.is_meta else bias
            self._buffers["expert_bias"] = source.to(device=moved.device, dtype=keep)
        return out

    def reset_counters(self) -> None:
        """Zero ``tokens_per_expert`` (and ``dropped_per_expert``): a new counting window."""
        with torch.no_grad():
            self.tokens_per_expert.zero_()
            if self.dropped_per_expert is not None:
                self.dropped_per_expert.zero_()

    def count_tokens(self, counts_E: torch.Tensor, dropped_E: torch.Tensor | None = None) -> None:
        """Add ``counts_E`` to ``tokens_per_expert`` in training mode, except during recompute.

        See Note [Counting under activation checkpointing]. Under ``torch.compile`` this is the
        one graph break of a training forward (Note [MoE under torch.compile] in ``layer.py``):
        whether the forward runs as an activation-checkpoint recompute is known only when it
        runs, so the update runs eagerly, outside the graph.
        """
        if self.training:
            count_unless_recompute(self, counts_E, dropped_E)

    def _check_input(self, x_TD: torch.Tensor, num_sequences: int) -> None:
        if x_TD.dim() != 2 or x_TD.shape[-1] != self.config.dim:
            raise ValueError(
                f"the router expects x_TD of shape (tokens, dim={self.config.dim}), got "
                f"{tuple(x_TD.shape)}"
            )
        if num_sequences < 1 or x_TD.shape[0] % num_sequences != 0:
            raise ValueError(
                f"the router got {x_TD.shape[0]} tokens, not divisible into "
                f"num_sequences={num_sequences} sequences of equal length"
            )

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"num_experts={cfg.num_experts}, top_k={cfg.top_k}, score_func={cfg.score_func!r}, "
            f"expert_bias={cfg.use_expert_bias}, aux_loss_coeff={cfg.aux_loss_coeff}, "
            f"aux_loss_type={cfg.aux_loss_type!r}, z_loss_coeff={cfg.z_loss_coeff}"
            + (
                f", {_capacity_repr(cfg)}, drop_policy={cfg.drop_policy!r}, "
                f"pad_to_capacity={cfg.pad_to_capacity}"
                if cfg.has_capacity
                else ""
            )
            + (", force_balanced_routing=True" if cfg.force_balanced_routing else "")
        )


# Note [Attached router losses under loss scaling]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the attach route (``aux_loss_mode="attach"``, or a collect-mode loss attached by a
# reentrant checkpoint's recompute) nothing tells the layer what was done to the loss: backward
# hands ``y`` only ``dL/dy`` (Note [Auxiliary loss follows the loss] in ``balance.py``). So the
# factor between the tensor that backward starts from and "the loss" is configuration, on each
# router: ``aux_loss_scale``, the weight that :class:`~dtensor_moe.moe.balance.AuxLossBackward`
# hands the router losses instead of 1. Backward through ``y`` then adds
# ``scale * d(aux)/d(router)``, which is "aux added to the loss" when the backward starts from
# ``scale * loss``:
#
# * ``scaler.scale(loss)`` (``GradScaler``): ``scale = scaler.get_scale()``, set before each
#   step (the scale changes only in ``scaler.update()``), or the scale as a 0-dim tensor;
# * ``loss / n`` (gradient accumulation, or a pipeline schedule's ``loss_fn`` that divides with
#   ``scale_grads=False``): ``1 / n``; both: their product;
# * a pipeline schedule with ``scale_grads=True`` divides every gradient by the number of
#   micro-batches after the backward, the router losses' included: nothing to set for it.
#
# Under pipeline parallelism only the last stage computes the loss; the other stages receive
# ``dL/dy`` from the next stage, already scaled. Every stage's routers take the same scale, so
# each stage's router losses get the single-process weight.
#
# When the scale is read: a float is taken when the layer's forward runs. A 0-dim tensor is
# read when the backward runs in eager mode (its value then, so an in-place update between a
# forward and its backward applies), but under ``torch.compile`` (torch 2.13, ``aot_eager`` and
# ``inductor`` alike) the compiled graph reads it at the forward: AOT autograd moves the read
# into the forward graph and saves the value. So set the scale (or update the tensor in place)
# before the forwards of the step it applies to; eager and compiled then agree. That is where
# it changes anyway: a ``GradScaler``'s scale changes only in ``scaler.update()``, after the
# step. Under ``torch.compile`` a float scale is a constant of the graph (a new value
# recompiles), a tensor is an input. ``tests/test_config_validation.py`` shows both readings
# (``test_tensor_scale_read_at_backward_eagerly_at_forward_compiled``). No collective.


def set_router_loss_scale(
    modules: nn.Module | Iterable[nn.Module], scale: float | torch.Tensor
) -> None:
    """Weight the attached router losses' gradient by ``scale`` in every MoE router of
    ``modules`` (Note [Attached router losses under loss scaling]).

    On the attach route each backward through a layer's output adds ``scale`` times the router
    losses' gradient (1 as built). Set it to the factor by which the tensor that backward starts
    from differs from the loss: ``scaler.get_scale()`` under ``GradScaler``, ``1 / n`` for a
    loss divided by ``n``, their product for both. Under pipeline parallelism set it on every
    stage module of every rank, stages that never see the loss included; a schedule's
    ``scale_grads=True`` needs nothing. A collected loss (inside ``collect_aux_losses()``) is
    part of your loss and ignores it.

    Args:
        modules: a module, or several (the stage modules of a rank); a module without MoE
            routers (a dense pipeline stage) is left as it is.
        scale: a finite float ``>= 0``, or a 0-dim floating tensor (set it once and update it
            in place, or pass a new one each step). Set or update it before the forwards of
            the step it applies to: a tensor's value is read when the backward runs in eager
            mode, but at the forward under ``torch.compile`` (Note [Attached router losses
            under loss scaling]).

    Raises:
        TypeError: ``scale`` is neither a real number nor a 0-dim floating tensor.
        ValueError: a float ``scale`` that is negative, ``nan`` or infinite.
    """
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not scale.is_floating_point():
            raise TypeError(
                f"set_router_loss_scale: a tensor scale must be 0-dim and floating, got shape "
                f"{tuple(scale.shape)} and dtype {scale.dtype}"
            )
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not math.isfinite(scale) or scale < 0:
            raise ValueError(
                f"set_router_loss_scale: scale={scale} must be finite and >= 0 (for a "
                "GradScaler: scaler.get_scale(); for a loss divided by n: 1 / n)"
            )
        scale = float(scale)
    else:
        raise TypeError(
            f"set_router_loss_scale: scale must be a float or a 0-dim tensor, got "
            f"{type(scale).__name__}"
        )
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        for router in module.modules():
            if is_router(router):
                router.aux_loss_scale = scale


def _capacity_repr(cfg: MoEConfig) -> str:
    if cfg.capacity_per_expert is not None:
        return f"capacity_per_expert={cfg.capacity_per_expert}"
    return f"capacity_factor={cfg.capacity_factor}"
