"""The MoE forward under tensor / sequence parallelism: which tokens each TP rank routes.

Shape legend:
    B  sequences, L  tokens per sequence (global, as the input DTensor says)
    D  model width        E  routed experts        K  experts per token
    T  tokens this rank routes (``x_TD``), flattened in the order of its local block
    t  tokens of this rank's 1/tp slice of the flattened ``B * L`` tokens

Note [Token-parallel MoE]
~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`~dtensor_moe.parallel.PrepareMoEInput` installs :class:`TokenParallelForward` as the
layer's ``parallel_forward`` (Note [Parallel forward hook] in ``dtensor_moe/moe/layer.py``). The
MoE input is a DTensor on the 1-D tp mesh, ``Shard(1)`` (sequence parallel; uneven lengths
allowed) or ``Replicate()``; a plain tensor counts as ``Replicate()``. The output has the
input's layout (and is a plain tensor when the input was). Two routings:

``"split"`` (EP borrows the tp ranks): every token is routed by exactly one tp rank.
    ``Shard(1)``: a rank routes its own sequence shard ``(B, l_r, D)``; no collective on tp.
    ``Replicate()``: a rank routes its ``1/tp`` slice of the flattened tokens (DTensor's
    ``Shard(0)`` of the ``(B * L, D)`` view, which is ``TokenShardMeta(..., "flat")``); the
    output slices are all-gathered (DTensor pads the uneven slices to ``ceil(B*L/tp)`` rows, so
    sizes agree, and cuts the padding off again; padding is never routed). The experts must be
    expert-parallel over ranks that include the tp ranks, so their weight gradients are
    ``Shard(0)`` DTensors and need no tp reduction.

``"replicate"`` (expert tensor parallelism): every tp rank routes all tokens of the tp group
    (a ``Shard(1)`` input is all-gathered). Each rank computes a hidden-dim slice of every
    expert (and of the shared experts), so the outputs are ``Partial`` and are reduced to the
    input layout: reduce-scatter for ``Shard(1)``, all-reduce for ``Replicate()``.

The routed region (router top-k, dispatch, experts, combine) runs on local tensors. Its DTensor
inputs, the tokens and the router logits, become local with gradient placements derived from
the region's output (:func:`region_grad_placements`): under ``"split"`` the output is a shard,
and a shard's gradient is a shard; under ``"replicate"`` the output is ``Partial``, so the
local gradient of a replicated input is a partial sum (``Partial``). The router gate and the
shared experts run as DTensor ops on the token DTensor, so DTensor derives their gradients:
a ``Replicate`` weight used on split tokens gets a ``Partial`` gradient (reduced over tp by
FSDP2, by ``full_tensor()`` or by the optimizer), a column/row-sharded weight a sharded one.

Router statistics are global (see Note [Global router statistics]).
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from dtensor_moe import _compat
from dtensor_moe.moe.balance import attach_aux_loss
from dtensor_moe.moe.experts import shared_mlp
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.losses import LossTokens, router_losses
from dtensor_moe.moe.router import RouterOutput, TokenChoiceTopKRouter, expert_counts
from dtensor_moe.parallel.mesh import local_rank, mesh_ranks
from dtensor_moe.parallel.padding import TokenShardMeta

__all__ = ["Routing", "TokenParallelForward", "region_grad_placements"]

Routing: TypeAlias = Literal["split", "replicate"]
ROUTINGS: tuple[Routing, ...] = ("split", "replicate")
INPUT_LAYOUTS: tuple[Placement, ...] = (Shard(1), Replicate())


def region_grad_placements(
    in_placements: tuple[Placement, ...], region_output: Placement
) -> list[Placement]:
    """Gradient placements of a DTensor input made local for the routed region.

    A sharded input's local gradient is the gradient of its shard (the shard is all this rank
    reads). A replicated input's local gradient is complete when the region's output is
    replicated too (every rank computed the same thing) and a partial sum otherwise (each rank
    produced a different shard or a partial sum of the output). See Note [Token-parallel MoE].
    """
    return [p if p.is_shard() or region_output.is_replicate() else Partial() for p in in_placements]


def _local_views(ts: tuple[DTensor, ...], region_output: Placement) -> tuple[torch.Tensor, ...]:
    """The local tensors of ``ts`` inside the routed region, with derived gradient placements
    (:func:`region_grad_placements`), as one autograd node (``_compat.local_views``)."""
    grad_placements = tuple(tuple(region_grad_placements(t.placements, region_output)) for t in ts)
    return _compat.local_views(ts, grad_placements)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Tokens:
    """The tokens this rank routes, for one forward (see Note [Token-parallel MoE]).

    Attributes:
        x: DTensor on the tp mesh whose local tensor holds exactly these tokens.
        region_output: placement of the routed output on the tp mesh (a shard, or Partial).
        sequence_T: global sequence index of each local token.
        owned: the local tokens whose router statistics this rank counts (``None``: all).
    """

    x: DTensor
    region_output: Placement
    sequence_T: torch.Tensor
    owned: slice | None


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenParallelForward:
    """``parallel_forward`` of a :class:`~dtensor_moe.moe.MoE` under TP/SP.

    Keyword Args:
        mesh: the 1-D tp mesh.
        input_layout: ``Shard(1)`` or ``Replicate()``; the placement a DTensor input must have.
        routing: ``"split"`` or ``"replicate"``; see Note [Token-parallel MoE].

    Collectives on the tp mesh (besides the experts' own all-to-alls on the EP mesh):

    ========================  ======================  ========================
    routing / input            forward                 backward
    ========================  ======================  ========================
    split / ``Shard(1)``       none                    none
    split / ``Replicate``      all-gather (output)     all-gather (input grad)
    replicate / ``Shard(1)``   all-gather, reduce-sc.  all-gather, reduce-sc.
    replicate / ``Replicate``  all-reduce              all-reduce
    ========================  ======================  ========================

    plus, in training with ``aux_loss_coeff > 0`` or ``z_loss_coeff > 0`` and ``"split"``
    routing, one forward all-reduce of the router statistics (over the router's
    ``aux_loss_group`` instead of tp for a ``"global_batch"`` balance loss with a group, which
    also adds it under ``"replicate"``).
    """

    mesh: DeviceMesh
    input_layout: Placement
    routing: Routing
    # Note [Ranks of a mesh, read once]
    tp_ranks: tuple[int, ...] = field(init=False)
    tp_rank: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_ranks", mesh_ranks(self.mesh))
        object.__setattr__(self, "tp_rank", local_rank(self.mesh))

    def __call__(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        self.check_experts(moe)
        x_in = self._input(moe, x)
        B, L, D = x_in.shape
        tokens = self._tokens(x_in)
        shared = moe.shared_experts
        shared_ws = () if shared is None else shared.weights()
        x_local, gate_local, *shared_local = _local_views(
            (tokens.x, moe.router.gate.weight, *shared_ws), tokens.region_output
        )
        x_TD = x_local.reshape(-1, D)
        logits_TE = F.linear(x_TD.to(gate_local.dtype), gate_local)  # as the router: gate dtype
        routing, owned_counts_E = self._route(
            moe.router, logits_TE, tokens, x_TD.dtype, batch=B, seq_len=L
        )
        # Only plain tensors and shapes stay alive past the experts, which break the graph
        # under torch.compile (Note [Expert parallelism under torch.compile]): a DTensor, or a
        # view of one, carried across the break would become a graph output whose gradient
        # AOT autograd cannot match.
        region_output, region_shape = tokens.region_output, tokens.x.shape
        local_shape = x_local.shape
        del tokens, x_in, x_local
        y_TD = moe.experts(x_TD, routing.topk_scores_TK, routing.topk_ids_TK, routing.counts_E)
        if isinstance(y_TD, DTensor):  # expert TP: a Partial DTensor on the etp mesh
            y_TD = y_TD.to_local()
        if shared is not None:
            y_TD = y_TD + shared_mlp(x_TD, *shared_local)
        if routing.aux_loss is not None:
            y_TD = attach_aux_loss(y_TD, routing.aux_loss, mode=moe.config.aux_loss_mode)
        y = DTensor.from_local(
            y_TD.view(local_shape),
            self.mesh,
            [region_output],
            shape=region_shape,
            stride=_compat.contiguous_stride(region_shape),
        )
        y = self._output(y, (B, L, D))
        # Last, as in MoE.forward: under torch.compile, the eager counter update is the one
        # break of a training forward besides the experts (Note [MoE under torch.compile]).
        moe.router.count_tokens(owned_counts_E)
        return y if isinstance(x, DTensor) else y.to_local()

    # -- validation -------------------------------------------------------------------------

    def check_experts(self, moe: MoE) -> None:
        """The experts' parallelism must match the routing (attribute checks, no collective).

        Compares rank tuples that the dispatcher and this object read once, at construction
        (Note [Ranks of a mesh, read once]), so it costs nothing and traces under
        ``torch.compile`` as constants.
        """
        dispatcher = moe.experts.dispatcher
        partial = getattr(dispatcher, "partial_ranks", ())
        tp_ranks = self.tp_ranks
        if self.routing == "replicate":
            if partial != tp_ranks:
                raise ValueError(
                    "PrepareMoEInput(routing='replicate') needs the experts sharded with "
                    "ExpertTensorParallel on ranks equal to the tp mesh "
                    f"{list(tp_ranks)}; got dispatcher {dispatcher!r}"
                )
            return
        ep_ranks = getattr(dispatcher, "ranks", ())
        if partial or not set(tp_ranks) <= set(ep_ranks):
            raise ValueError(
                "PrepareMoEInput(routing='split') routes different tokens on each tp rank, so "
                "the experts must exchange rows over a mesh containing the tp ranks "
                f"{list(tp_ranks)}: ExpertParallel over an EP mesh that borrows them, or "
                f"ExpertTensorParallel(dispatch='all_to_all'); got dispatcher {dispatcher!r}. "
                "ExpertTensorParallel(dispatch='gather') needs routing='replicate'"
            )

    def _input(self, moe: MoE, x: torch.Tensor) -> DTensor:
        """``x`` as a DTensor with ``input_layout``, its gradient returned in that layout."""
        if not isinstance(x, DTensor):
            if self.input_layout.is_shard():
                raise ValueError(
                    "PrepareMoEInput(input_layout=Shard(1)) got a plain tensor; pass the "
                    "sequence-parallel activation as a DTensor (for example "
                    "use_local_output=False on the previous layer), so that uneven sequence "
                    "shards keep their global length"
                )
            moe._check_input(x)
            return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        if x.device_mesh != self.mesh or tuple(x.placements) != (self.input_layout,):
            raise ValueError(
                f"PrepareMoEInput expects the MoE input on {self.mesh} with placements "
                f"({self.input_layout!r},), got {x.device_mesh} with {tuple(x.placements)!r}; "
                "redistribute the input, or apply PrepareMoEInput with "
                "input_layout=Shard(1) (sequence parallel) or Replicate()"
            )
        moe._check_input(x)
        if self.input_layout.is_shard():
            self._check_sequence_shard(x)
        if self.routing == "split" and self.input_layout.is_shard():
            # The routed region reads x's own shards and returns gradients in x's placements.
            return x
        # A round trip whose backward redistributes the gradient to the input's placements.
        return DTensor.from_local(
            x.to_local(), self.mesh, x.placements, shape=x.shape, stride=x.stride()
        )

    def _check_sequence_shard(self, x: DTensor) -> None:
        """The local shard of a ``Shard(1)`` input must be DTensor's own split of its shape.

        ``DTensor.from_local(..., shape=...)`` does not check this; a shard of another length
        would route wrong sequence indices (and DTensor's padded collectives would misalign).
        Checked before any collective, on each rank from its own shard: every rank whose shard
        disagrees raises (a rank cannot see another's shard without a collective).
        """
        B, L, D = x.shape
        rank = self.tp_rank
        meta = TokenShardMeta.from_shape(B, L, self.mesh.size(), 1)
        expected = (B, meta.local_len(rank), D)
        local_shape = tuple(_compat.local_tensor(x).shape)
        if local_shape != expected:
            raise ValueError(
                f"PrepareMoEInput: the Shard(1) input of global shape {tuple(x.shape)} holds a "
                f"local shard of shape {local_shape} on tp rank {rank}, but DTensor's split of "
                f"L={L} over tp={self.mesh.size()} gives it {expected} (lengths "
                f"{list(meta.local_lens)}); build the input with distribute_tensor or "
                "redistribute, or pass DTensor.from_local shards of exactly those lengths"
            )

    # -- tokens in, output out ----------------------------------------------------------------

    def _tokens(self, x_in: DTensor) -> _Tokens:
        B, L, D = x_in.shape
        tp, rank = self.mesh.size(), self.tp_rank
        device = x_in.device
        if self.routing == "replicate":
            x = x_in.redistribute(self.mesh, [Replicate()])
            flat = TokenShardMeta.from_shape(B, L, tp, "flat")
            start = flat.offset(rank)
            owned = slice(start, start + flat.local_len(rank))
            sequence_T = torch.arange(B * L, device=device) // max(L, 1)
            return _Tokens(x=x, region_output=Partial(), sequence_T=sequence_T, owned=owned)
        if self.input_layout.is_shard():
            meta = TokenShardMeta.from_shape(B, L, tp, 1)
            x = x_in
        else:
            meta = TokenShardMeta.from_shape(B, L, tp, "flat")
            x = x_in.view(B * L, D).redistribute(self.mesh, [Shard(0)])
        # x's local rows are meta's split: a Shard(1) input was checked in _input, and the
        # flat Shard(0) above is DTensor's own redistribute (test_padding pins the agreement).
        sequence_T = meta.global_token_index(rank, device=device) // max(L, 1)
        return _Tokens(x=x, region_output=x.placements[0], sequence_T=sequence_T, owned=None)

    def _output(self, y: DTensor, shape: tuple[int, int, int]) -> DTensor:
        if y.placements[0] == self.input_layout:
            return y
        y = y.redistribute(self.mesh, [self.input_layout])
        return y.view(shape)

    # -- router statistics --------------------------------------------------------------------

    def _route(
        self,
        router: TokenChoiceTopKRouter,
        logits_TE: torch.Tensor,
        tokens: _Tokens,
        dtype: torch.dtype,
        *,
        batch: int,
        seq_len: int,
    ) -> tuple[RouterOutput, torch.Tensor]:
        """The router's steps on local logits, with global statistics, and the counts of the
        tokens this rank counts in ``tokens_per_expert`` (the caller adds them last).

        Note [Global router statistics]: every token is counted by exactly one rank of the
        world. Under ``"split"`` a rank counts the tokens it routes; under ``"replicate"`` all
        tp ranks route the same tokens, so a rank counts only its ``1/tp`` flat slice
        (``tokens.owned``). Summing the counters over all ranks (``update_expert_bias(...,
        process_group=dist.group.WORLD)``) therefore gives the global count and the same bias
        update on every rank. The router losses (balance and z-loss) of a data-parallel rank
        are the single-device losses of its batch: the statistics are summed over the tp ranks
        (one all-reduce under ``"split"``; local under ``"replicate"``), and each rank adds
        the share of the losses that its own tokens carry, so the shares add up over tp to the
        losses, and so do their gradients (Note [Router loss shares] in
        ``dtensor_moe/moe/losses.py``, which also says how a ``"global_batch"`` balance loss
        reduces over its ``aux_loss_group`` instead).
        """
        cfg = router.config
        scores_TE = router.scores(logits_TE)
        topk_ids_TK = router.select(scores_TE)
        topk_scores_TK = router.combine_weights(scores_TE, topk_ids_TK)
        counts_E = expert_counts(topk_ids_TK, cfg.num_experts)
        owned_counts_E = counts_E
        if tokens.owned is not None:
            owned_counts_E = expert_counts(topk_ids_TK[tokens.owned], cfg.num_experts)
        loss_tokens = LossTokens(
            sequence_T=tokens.sequence_T,
            num_sequences=batch,
            seq_len=seq_len,
            owned=tokens.owned,
            shard_group=self.mesh if tokens.owned is None else None,
        )
        aux_loss = router_losses(router, logits_TE, scores_TE, topk_ids_TK, loss_tokens)
        routing = RouterOutput(
            topk_scores_TK=topk_scores_TK.to(dtype),
            topk_ids_TK=topk_ids_TK,
            counts_E=counts_E,
            aux_loss=aux_loss,
        )
        return routing, owned_counts_E
