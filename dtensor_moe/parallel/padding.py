"""Uneven-split metadata: how the tokens of a (B, L, D) activation spread over one mesh dim.

Note [Virtual padding]
~~~~~~~~~~~~~~~~~~~~~~
Real sequence lengths are not multiples of the tp size, so the tokens an MoE layer routes under
tensor/sequence parallelism (Note [Token-parallel MoE] in ``token_parallel.py``) are split
*unevenly*: some ranks hold fewer tokens than others, and trailing ranks may hold none. What the
library does about it at run time:

1. **The split is DTensor's own.** Along the split dim of extent ``n``, every rank gets a chunk
   of ``P = ceil(n / world)`` elements in rank order, cut off at ``n``; ranks past the end get
   zero. This is what ``compute_local_shape_and_global_offset`` gives for a ``Shard`` placement
   (7 over 4 is ``[2, 2, 2, 1]``, 4 over 3 is ``[2, 2, 0]``); :class:`TokenShardMeta` computes
   it from public arithmetic (``tests/test_padding.py`` checks it against the torch internal).
   ``TokenParallel`` checks that the local shard of a ``Shard(1)`` input has exactly
   this length before any collective (``DTensor.from_local(..., shape=...)`` does not).
2. **The library never pads a token tensor.** Where uneven shards meet a collective on the tp
   mesh, that collective is DTensor's ``redistribute``: the all-gather of the output slices
   (``Shard(0)`` of the flat tokens to ``Replicate``) and of the input gradient under
   ``"split"`` routing of a ``Replicate`` input; the all-gather of a ``Shard(1)`` input and the
   reduce-scatter of the ``Partial`` output under ``"replicate"`` routing. DTensor (torch 2.13,
   ``Shard._to_replicate_tensor`` / ``Shard._reduce_shard_tensor``) pads each shard to ``P``
   rows for the collective, so sizes agree on every rank, including ranks with zero tokens, and
   cuts the padding off after it. The padding is *virtual* for the MoE: the routed region only
   ever sees the real local rows, so no padding row is routed, counted in router statistics
   (token counts, auxiliary loss, expert-bias updates) or given gradient. The expert-parallel
   all-to-alls do not pad either: they are variable-split, with the sizes exchanged first
   (Note [All-to-all dispatch] in ``dispatch.py``). (``MoEConfig.pad_multiple`` is a different
   thing: alignment padding of each expert's row group, see ``dtensor_moe/routed/layouts.py``.)
3. **Global token indices are batch-aware.** A local token's index into the flattened global
   ``(B * L)`` token order is ``b * L + offset_r + l`` for a sequence split (``Shard(1)``);
   ``local_idx + T_local * rank`` is wrong as soon as ``B > 1``
   (:meth:`TokenShardMeta.global_token_index`). ``TokenParallel`` uses it to find each
   token's sequence for the per-sequence auxiliary-loss statistics, and the ``"flat"`` split's
   :meth:`~TokenShardMeta.offset` / :meth:`~TokenShardMeta.local_len` to pick the ``1/tp``
   slice whose tokens a rank counts under ``"replicate"`` routing (Note [Global router
   statistics]).

Two layouts of the token dim are described (``shard_dim``):

- ``1``: sequence parallel, ``Shard(1)`` of a ``(B, L, D)`` activation; ``n = L`` and the local
  shard is ``(B, l_r, D)``.
- ``"flat"`` (``None`` is accepted as an alias): a split of the flattened ``B * L`` tokens, when
  each tp rank routes a ``1/tp`` slice of a ``Replicate`` input (or counts one under
  ``"replicate"`` routing); ``n = B * L`` and the local shard is ``(t_r, D)``. This is the split
  ``Shard(0)`` gives for the ``(B * L, D)`` view of the activation.

Everything here is pure metadata and index arithmetic: no collective runs, in forward or in
backward.

Shape legend:
    B: global batch size          L: global sequence length        D: hidden size
    n: extent of the split dim (``L`` or ``B * L``)
    l_r: real length of rank r along the split dim
    P: ``ceil(n / world)``, DTensor's chunk length (and the length its collectives pad to)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

__all__ = [
    "ShardDim",
    "TokenShardMeta",
]

ShardDim: TypeAlias = Literal[1, "flat"]
_SHARD_DIMS: tuple[ShardDim, ...] = (1, "flat")


def _split(n: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DTensor's uneven ``Shard`` split of ``n`` over ``world``: (lengths, offsets).

    Mirrors ``Shard.local_shard_size_and_offset`` (torch 2.13): chunk ``ceil(n / world)``,
    offset ``min(n, chunk * r)``, length clipped at ``n`` and at zero (so the lengths sum to
    ``n``; ``tests/test_padding.py`` checks every split against DTensor's).
    """
    chunk = -(-n // world)
    offsets = tuple(min(n, chunk * r) for r in range(world))
    lengths = tuple(max(0, min(n, chunk * (r + 1)) - chunk * r) for r in range(world))
    return lengths, offsets


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenShardMeta:
    """How the tokens of a ``(B, L, D)`` activation spread over one mesh dim of size ``world``.

    Construct with the keyword arguments below or with :meth:`from_shape`; the per-rank fields
    are derived. See Note [Virtual padding] in this module for what the library does with it.

    Keyword Args:
        batch_size (int): global ``B`` (``>= 0``).
        seq_len (int): global ``L`` (``>= 0``).
        world (int): size of the mesh dim the tokens are split over (``>= 1``).
        shard_dim (``1`` or ``"flat"``): which dim is split: ``1`` for ``Shard(1)`` (sequence
            parallel), ``"flat"`` for the flattened ``B * L`` tokens. ``None`` is accepted as an
            alias of ``"flat"``.

    Derived fields:
        local_lens: real length of every rank along the split dim (DTensor's uneven split).
        offsets: global offset of every rank along the split dim.

    Example::

        >>> meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        >>> meta.local_lens, meta.offsets
        ((2, 2, 2, 1), (0, 2, 4, 6))
    """

    batch_size: int
    seq_len: int
    world: int
    shard_dim: ShardDim
    local_lens: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.shard_dim is None:
            object.__setattr__(self, "shard_dim", "flat")
        for name in ("batch_size", "seq_len", "world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TokenShardMeta: {name} must be an int, got {value!r}")
        if self.batch_size < 0 or self.seq_len < 0:
            raise ValueError(
                f"TokenShardMeta: sizes must be >= 0, got batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}"
            )
        if self.world < 1:
            raise ValueError(f"TokenShardMeta: world must be >= 1, got world={self.world}")
        if isinstance(self.shard_dim, bool) or self.shard_dim not in _SHARD_DIMS:
            raise ValueError(
                f"TokenShardMeta: shard_dim must be 1 (Shard(1), sequence) or 'flat' (flattened "
                f"B*L tokens; None is an alias), got {self.shard_dim!r}; for a Shard(1) "
                "placement pass 1, for a split of the (B*L, D) view pass 'flat'"
            )
        lengths, offsets = _split(self.dim_len, self.world)
        object.__setattr__(self, "local_lens", lengths)
        object.__setattr__(self, "offsets", offsets)

    @classmethod
    def from_shape(
        cls, batch_size: int, seq_len: int, world: int, shard_dim: ShardDim | None
    ) -> TokenShardMeta:
        """Metadata for a global ``(batch_size, seq_len, D)`` activation split ``world`` ways."""
        return cls(batch_size=batch_size, seq_len=seq_len, world=world, shard_dim=shard_dim)

    # -- global quantities ------------------------------------------------------------------

    @property
    def dim_len(self) -> int:
        """``n``: the global extent of the split dim (``L`` or ``B * L``)."""
        return self.seq_len if self.shard_dim == 1 else self.batch_size * self.seq_len

    # -- per-rank quantities ----------------------------------------------------------------

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(
                f"TokenShardMeta: rank must be an int in [0, {self.world}) for world={self.world}, "
                f"got rank={rank!r}"
            )
        return rank

    def local_len(self, rank: int) -> int:
        """``l_r``: real length of ``rank`` along the split dim (may be 0)."""
        return self.local_lens[self._check_rank(rank)]

    def offset(self, rank: int) -> int:
        """Global offset of ``rank``'s shard along the split dim (``n`` for an empty shard)."""
        return self.offsets[self._check_rank(rank)]

    def global_token_index(
        self, rank: int, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Index into the flattened global ``(B * L)`` tokens of each local token.

        Returns:
            ``idx_T`` (int64), in the order of the flattened local shard: ``(b, l)`` for
            ``Shard(1)``, where ``idx = b * L + offset_r + l``; ``t`` for ``"flat"``, where
            ``idx = offset_r + t``.
        """
        length, start = self.local_len(rank), self.offset(rank)
        if self.shard_dim == 1:
            rows_B1 = torch.arange(self.batch_size, device=device).unsqueeze(1) * self.seq_len
            cols_1l = torch.arange(start, start + length, device=device).unsqueeze(0)
            return (rows_B1 + cols_1l).reshape(-1)
        return torch.arange(start, start + length, device=device)
