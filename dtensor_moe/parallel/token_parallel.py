"""The MoE layer under tensor / sequence parallelism: which tokens each TP rank routes.

Shape legend:
    B  sequences, L  tokens per sequence (global, as the input DTensor says)
    D  model width        E  routed experts        K  experts per token
    T  tokens this rank routes (``x_TD``), flattened in the order of its local block
    t  tokens of this rank's 1/tp slice of the flattened ``B * L`` tokens

Note [Token-parallel MoE]
~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`~dtensor_moe.parallel.PrepareMoEInput` sets a :class:`TokenParallel` as the layer's
``token_parallel`` and registers its :meth:`~TokenParallel.input_hook` and
:meth:`~TokenParallel.output_hook` around the layer's own forward (Note [One forward] in
``dtensor_moe/moe/tokens.py``). The MoE input is a DTensor on the 1-D tp mesh, ``Shard(1)`` (sequence parallel; uneven lengths
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

Note [Short sequences under sequence parallelism]: DTensor's view rules cannot flatten a
``Shard(1)`` dim that leaves some rank no element (torch 2.13: ``L < tp`` makes a linear layer
on the ``(B, L, D)`` shard all-gather its input, or raise when ``L == 1``). So under ``"split"``
a ``Shard(1)`` input with ``L < tp`` (decoding one token, say) is routed like a replicated one:
all-gathered, and split into ``1/tp`` slices of the flattened tokens; its output is gathered
and handed back as ``Shard(1)``. ``tests/test_moe_composable.py`` shows the DTensor behaviour
that needs it.

``"replicate"`` (expert tensor parallelism): every tp rank routes all tokens of the tp group
    (a ``Shard(1)`` input is all-gathered). Each rank computes a hidden-dim slice of every
    expert (and of the shared experts), so the outputs are ``Partial`` and are reduced to the
    input layout: reduce-scatter for ``Shard(1)``, all-reduce for ``Replicate()``.

The router gate and the shared experts run as modules on the token DTensor (the input hook's
output) with DTensor weights, so DTensor derives their gradients: a ``Replicate`` weight used
on split tokens gets a ``Partial`` gradient (reduced over tp by FSDP2, by ``full_tensor()`` or
by the optimizer), a column/row-sharded weight a sharded one. The routed region (router
top-k, dispatch, experts, combine) runs on local tensors: the tokens, the gate logits and the
shared output become local (:meth:`TokenSplit.local`) with gradient placements derived from
the region's output (:func:`region_grad_placements`): under ``"split"`` the output is a shard,
and a shard's gradient is a shard; under ``"replicate"`` the output is ``Partial``, so the
local gradient of a replicated input is a partial sum (``Partial``).

Router statistics are global (see Note [Global router statistics]).
"""

# ruff: noqa: N806

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from dtensor_moe import _compat
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.losses import LossTokens
from dtensor_moe.moe.tokens import RoutedTokens
from dtensor_moe.routed.exchange import local_rank, mesh_ranks
from dtensor_moe.parallel.padding import TokenShardMeta

__all__ = ["Routing", "TokenParallel", "TokenSplit", "region_grad_placements"]

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
    produced a different shard or a partial sum of the output). A ``Partial`` input (the shared
    experts' output under expert tensor parallelism) is a summand of the ``Partial`` output on
    each rank, so each rank's local gradient is the whole gradient: ``Replicate()``. See Note
    [Token-parallel MoE].
    """
    return [_grad_placement(p, region_output) for p in in_placements]


def _grad_placement(p: Placement, region_output: Placement) -> Placement:
    if p.is_partial():
        return Replicate()
    return p if p.is_shard() or region_output.is_replicate() else Partial()


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenSplit(RoutedTokens):
    """The tokens this tp rank routes in one forward (built by :meth:`TokenParallel.input_hook`
    and passed to ``MoE.forward`` as ``tokens``; see Note [Token-parallel MoE]).

    Attributes (besides :class:`~dtensor_moe.moe.tokens.RoutedTokens`'):
        mesh: the tp mesh.
        region_output: placement of the routed output on the tp mesh (a shard, or Partial).
        shape: global shape of the token DTensor the layer receives.
        sequence_T: global sequence index of each local token.
        shard_group: the tp mesh when the batch's tokens are split over it, else ``None``.
        local_output: the layer's input was a plain tensor, so its output is one too.
        flat_rows: this rank's rows of the flattened ``B * L`` tokens when it routes a ``1/tp``
            slice of them (``"split"`` routing of a replicated input or a short sequence),
            else ``None``.
        split_meta: how the batch's tokens are split over the tp mesh under ``"split"``
            routing (``None`` under ``"replicate"``: every rank routes all of them).
        rank: this rank's position on the tp mesh.
    """

    mesh: DeviceMesh
    region_output: Placement
    shape: torch.Size
    sequence_T: torch.Tensor
    shard_group: DeviceMesh | None
    local_output: bool
    flat_rows: slice | None
    split_meta: TokenShardMeta | None
    rank: int

    def local(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        if t.placements[0].is_replicate() and self.flat_rows is not None:
            # Fewer flat tokens than tp ranks: DTensor does not shard a dim smaller than the
            # mesh, so the module ran on all tokens. Take this rank's rows; the other ranks'
            # rows get no gradient here, so the local gradient is a partial sum.
            return _compat.local_views((t,), ((Partial(),),))[0][self.flat_rows]
        if t.placements[0].is_shard() != self.region_output.is_shard():
            raise RuntimeError(
                f"PrepareMoEInput: a module of the MoE layer returned a DTensor with placements "
                f"{t.placements!r} on {t.device_mesh}, but the tokens this rank routes are "
                f"{self.region_output!r}; the router gate and the shared experts must act on "
                "each token separately (row-wise), so that their outputs keep the tokens' split"
            )
        grad_placements = tuple(region_grad_placements(t.placements, self.region_output))
        return _compat.local_views((t,), (grad_placements,))[0]

    def batch_table(
        self, ids_TK: torch.Tensor, scores_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The whole batch's routing table: under ``"split"`` routing, one all-gather on the tp
        mesh of every rank's ids and scores (float64, exact; no gradient), each rank's rows
        padded to the longest and placed at their global token index (Note [Expert capacity]
        in ``dtensor_moe/moe/capacity.py``)."""
        meta = self.split_meta
        if meta is None:
            return ids_TK, scores_TK, None
        K, dev = ids_TK.shape[1], ids_TK.device
        index = [meta.global_token_index(r, device=dev) for r in range(meta.world)]
        rows = [i.numel() for i in index]
        table_TC = torch.cat((ids_TK.to(torch.float64), scores_TK.detach().to(torch.float64)), 1)
        padded_TC = table_TC.new_zeros(max(rows), 2 * K)
        padded_TC[: table_TC.shape[0]] = table_TC
        gathered = funcol.wait_tensor(funcol.all_gather_single(padded_TC, 0, self.mesh))
        parts = [gathered[r * max(rows) : r * max(rows) + n] for r, n in enumerate(rows)]
        batch_bC = table_TC.new_empty(sum(rows), 2 * K)
        batch_bC[torch.cat(index)] = torch.cat(parts)
        return batch_bC[:, :K].long(), batch_bC[:, K:], index[self.rank]

    def loss_tokens(self, num_tokens: int, device: torch.device) -> LossTokens:
        return LossTokens(
            sequence_T=self.sequence_T,
            num_sequences=self.num_sequences,
            seq_len=self.seq_len,
            owned=self.owned,
            shard_group=self.shard_group,
        )

    def output(self, y_TD: torch.Tensor) -> DTensor:
        """The routed output as a DTensor in ``region_output`` (the output hook brings it to
        the input's layout)."""
        return DTensor.from_local(
            y_TD.view(self.local_shape),
            self.mesh,
            [self.region_output],
            shape=self.shape,
            stride=_compat.contiguous_stride(self.shape),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenParallel:
    """The token-parallel plan of a :class:`~dtensor_moe.moe.MoE` (its ``token_parallel``).

    Keyword Args:
        mesh: the 1-D tp mesh.
        input_layout: ``Shard(1)`` or ``Replicate()``; the placement a DTensor input must have.
        routing: ``"split"`` or ``"replicate"``; see Note [Token-parallel MoE].

    Configuration, set once by :class:`~dtensor_moe.parallel.PrepareMoEInput`, which registers
    :meth:`input_hook` (a forward pre-hook) and :meth:`output_hook` (a forward hook) on the
    layer. Nothing writes it during a forward.

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

    def input_hook(
        self, moe: MoE, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: the input as the token DTensor this rank routes, and ``tokens``.

        Validates everything before the first collective, so every rank fails the same way.
        """
        if len(args) != 1 or kwargs:
            raise TypeError(
                "an MoE under PrepareMoEInput is called as moe(x) with one positional input, "
                f"got {len(args)} positional and keyword arguments {sorted(kwargs)}"
            )
        (x,) = args
        self.check_experts(moe)
        x_in = self._input(moe, x)
        x_tokens, split = self._tokens(x_in, local_output=not isinstance(x, DTensor))
        return (x_tokens,), {"tokens": split}

    def output_hook(
        self, moe: MoE, args: tuple[Any, ...], kwargs: dict[str, Any], y: DTensor
    ) -> torch.Tensor:
        """Forward hook: the output in the input's layout (a plain tensor for a plain input)."""
        split = kwargs["tokens"]
        if y.ndim == 2:  # a flat token split: gather, then the input's layout
            B, L = split.num_sequences, split.seq_len
            y = y.redistribute(self.mesh, [Replicate()]).view(B, L, y.shape[-1])
        if y.placements[0] != self.input_layout:
            y = y.redistribute(self.mesh, [self.input_layout])
        return y.to_local() if split.local_output else y

    # -- validation -------------------------------------------------------------------------

    def check_experts(self, moe: MoE) -> None:
        """The experts' parallelism must match the routing (attribute checks, no collective).

        Compares rank tuples that the exchange and this object read once, at construction
        (Note [Ranks of a mesh, read once]), so it costs nothing and traces under
        ``torch.compile`` as constants.
        """
        exchange = getattr(getattr(moe.experts, "plan", None), "exchange", None)
        partial = getattr(exchange, "partial_ranks", ())
        tp_ranks = self.tp_ranks
        if self.routing == "replicate":
            if partial != tp_ranks:
                raise ValueError(
                    "PrepareMoEInput(routing='replicate') needs the experts sharded with "
                    "ExpertTensorParallel on ranks equal to the tp mesh "
                    f"{list(tp_ranks)}; got exchange {exchange!r}"
                )
            return
        ep_ranks = getattr(exchange, "ranks", ())
        if partial or not set(tp_ranks) <= set(ep_ranks):
            raise ValueError(
                "PrepareMoEInput(routing='split') routes different tokens on each tp rank, so "
                "the experts must exchange rows over a mesh containing the tp ranks "
                f"{list(tp_ranks)}: ExpertParallel over an EP mesh that borrows them, or "
                f"ExpertTensorParallel(dispatch='all_to_all'); got exchange {exchange!r}. "
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

    def _tokens(self, x_in: DTensor, *, local_output: bool) -> tuple[DTensor, TokenSplit]:
        """The DTensor whose local tensor holds exactly the tokens this rank routes, and their
        :class:`TokenSplit`.

        Note [Global router statistics]: every token is counted by exactly one rank of the
        world. Under ``"split"`` a rank counts the tokens it routes; under ``"replicate"`` all
        tp ranks route the same tokens, so a rank counts only its ``1/tp`` flat slice
        (``owned``). Summing the counters over all ranks (``update_expert_bias(...,
        process_group=dist.group.WORLD)``) therefore gives the global count and the same bias
        update on every rank. The router losses (balance and z-loss) of a data-parallel rank
        are the single-device losses of its batch: the statistics are summed over the tp ranks
        (one all-reduce under ``"split"``; local under ``"replicate"``), and each rank adds
        the share of the losses that its own tokens carry, so the shares add up over tp to the
        losses, and so do their gradients (Note [Router loss shares] in
        ``dtensor_moe/moe/losses.py``, which also says how a ``"global_batch"`` balance loss
        reduces over its ``aux_loss_group`` instead).
        """
        B, L, D = x_in.shape
        tp, rank = self.mesh.size(), self.tp_rank
        device = x_in.device
        owned = flat_rows = meta = None
        if self.routing == "replicate":
            x = x_in.redistribute(self.mesh, [Replicate()])
            flat = TokenShardMeta.from_shape(B, L, tp, "flat")
            start = flat.offset(rank)
            owned = slice(start, start + flat.local_len(rank))
            sequence_T = torch.arange(B * L, device=device) // max(L, 1)
            region_output: Placement = Partial()
        else:
            if self.input_layout.is_shard() and L >= tp:
                meta = TokenShardMeta.from_shape(B, L, tp, 1)
                x = x_in
            else:
                # A Replicate input, or a sequence shorter than tp (Note [Short sequences under
                # sequence parallelism]): a 1/tp slice of the flattened tokens.
                meta = TokenShardMeta.from_shape(B, L, tp, "flat")
                x = x_in.redistribute(self.mesh, [Replicate()])
                x = x.view(B * L, D).redistribute(self.mesh, [Shard(0)])
                start = meta.offset(rank)
                flat_rows = slice(start, start + meta.local_len(rank))
            # x's local rows are meta's split: a Shard(1) input was checked in _input, and the
            # flat Shard(0) above is DTensor's own redistribute (test_padding pins the
            # agreement).
            sequence_T = meta.global_token_index(rank, device=device) // max(L, 1)
            region_output = x.placements[0]
        split = TokenSplit(
            num_sequences=B,
            seq_len=L,
            local_shape=tuple(_compat.local_tensor(x).shape),
            owned=owned,
            mesh=self.mesh,
            region_output=region_output,
            shape=x.shape,
            sequence_T=sequence_T,
            shard_group=self.mesh if owned is None else None,
            local_output=local_output,
            flat_rows=flat_rows,
            split_meta=meta,
            rank=rank,
        )
        return x, split
