"""Virtual-padding metadata: how the tokens of a (B, L, D) activation spread over one mesh dim.

Note [Virtual padding]
~~~~~~~~~~~~~~~~~~~~~~
Real sequence lengths are not multiples of the mesh size, so the tokens of an activation are
split *unevenly*: some ranks hold fewer tokens than others, and trailing ranks may hold none.
Collectives, however, need sizes that every rank agrees on. The contract is:

1. **The split is DTensor's own.** Along the sharded dim of extent ``n``, every rank gets a
   chunk of ``P = ceil(n / world)`` elements in rank order, except that the chunks are cut off
   at ``n``; ranks past the end get zero. This is exactly what
   ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` gives for a
   ``Shard`` placement (for example 7 over 4 is ``[2, 2, 2, 1]`` and 4 over 3 is ``[2, 2, 0]``),
   so a local shard of a DTensor and the :class:`TokenShardMeta` of its global shape always
   agree. The split is computed here from public arithmetic, not from the torch internal.
2. **Collectives run at padded sizes.** Before a collective, each rank pads its local shard with
   zeros up to ``P`` along the sharded dim (:meth:`TokenShardMeta.pad`); after it, each padded
   block is cut back to its real length (:meth:`TokenShardMeta.unpad`). ``P`` depends only on
   the global shape and the mesh size, so it is the same on every rank, including ranks that
   hold zero real tokens.
3. **Padding rows are virtual.** They are never routed to an expert, never counted in router
   statistics (token counts, auxiliary loss, expert-bias updates), and never given gradient.
   :meth:`TokenShardMeta.valid_mask` marks the real rows of a padded, flattened local block;
   counts and losses are weighted by :meth:`TokenShardMeta.num_tokens`, never by the padded size.
   ``unpad`` is a ``narrow`` (a view), so autograd sends exactly zero gradient to the padding
   rows, and ``pad`` is a concatenation with fresh zeros, so the real rows' gradient is the
   slice of the padded gradient.
4. **Global token indices are batch-aware.** A local token's index into the flattened global
   ``(B * L)`` token order is ``b * L + offset_r + l`` for a sequence split (``Shard(1)``);
   ``local_idx + T_local * rank`` is wrong as soon as ``B > 1``
   (:meth:`TokenShardMeta.global_token_index`).

Three layouts of the token dim are supported (``shard_dim``):

- ``1``: sequence parallel, ``Shard(1)`` of a ``(B, L, D)`` activation; ``n = L`` and the local
  shard is ``(B, l_r, D)``.
- ``0``: ``Shard(0)`` of a ``(B, L, D)`` activation on the batch dim; ``n = B`` and the local
  shard is ``(b_r, L, D)``.
- ``"flat"`` (``None`` is accepted as an alias): a split of the flattened ``B * L`` tokens, for
  example when EP borrows the TP ranks and each rank routes a ``1/tp`` slice of a ``Replicate``
  input; ``n = B * L`` and the local shard is ``(t_r, D)``. This is the split ``Shard(0)`` gives
  for the ``(B * L, D)`` view of the activation.

Everything here is pure metadata and tensor arithmetic: no collective runs, in forward or in
backward.

Shape legend:
    B: global batch size          L: global sequence length        D: hidden size
    n: extent of the sharded dim (``L``, ``B`` or ``B * L``)
    l_r: real length of rank r along the sharded dim
    P: padded length ``ceil(n / world)``, the same on every rank
    T_r: real tokens on rank r (``num_tokens``)   T_P: tokens of a padded block (``padded_tokens``)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

__all__ = [
    "ShardDim",
    "TokenShardMeta",
]

ShardDim: TypeAlias = Literal[0, 1, "flat"]
_SHARD_DIMS: tuple[ShardDim, ...] = (0, 1, "flat")


def _split(n: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """DTensor's uneven ``Shard`` split of ``n`` over ``world``: (lengths, offsets, padded_len).

    Mirrors ``Shard.local_shard_size_and_offset`` (torch 2.13): chunk ``ceil(n / world)``,
    offset ``min(n, chunk * r)``, length clipped at ``n`` and at zero.
    """
    padded_len = -(-n // world)
    offsets = tuple(min(n, padded_len * r) for r in range(world))
    lengths = tuple(max(0, min(n, padded_len * (r + 1)) - padded_len * r) for r in range(world))
    assert sum(lengths) == n, f"split of {n} over {world} lost elements: {lengths}"
    return lengths, offsets, padded_len


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenShardMeta:
    """How the tokens of a ``(B, L, D)`` activation spread over one mesh dim of size ``world``.

    Construct with the keyword arguments below or with :meth:`from_shape`; the per-rank fields
    are derived. See Note [Virtual padding] in this module for the contract.

    Keyword Args:
        batch_size (int): global ``B`` (``>= 0``).
        seq_len (int): global ``L`` (``>= 0``).
        world (int): size of the mesh dim the tokens are split over (``>= 1``).
        shard_dim (``0``, ``1`` or ``"flat"``): which dim is split: ``1`` for ``Shard(1)``
            (sequence parallel), ``0`` for ``Shard(0)`` (batch), ``"flat"`` for the flattened
            ``B * L`` tokens. ``None`` is accepted as an alias of ``"flat"``.

    Derived fields:
        local_lens: real length of every rank along the sharded dim (DTensor's uneven split).
        offsets: global offset of every rank along the sharded dim.
        padded_len: ``ceil(n / world)``, the length every rank pads to.
        tokens_per_rank: real tokens of every rank (``local_lens`` times ``B`` for ``Shard(1)``,
            times ``L`` for ``Shard(0)``).

    Example::

        >>> meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        >>> meta.local_lens, meta.offsets, meta.padded_len, meta.tokens_per_rank
        ((2, 2, 2, 1), (0, 2, 4, 6), 2, (4, 4, 4, 2))
    """

    batch_size: int
    seq_len: int
    world: int
    shard_dim: ShardDim
    local_lens: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)
    padded_len: int = field(init=False)
    tokens_per_rank: tuple[int, ...] = field(init=False)

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
                f"TokenShardMeta: shard_dim must be 0 (Shard(0), batch), 1 (Shard(1), sequence) "
                f"or 'flat' (flattened B*L tokens; None is an alias), got {self.shard_dim!r}; "
                f"for a Shard(d) placement pass d"
            )
        lengths, offsets, padded_len = _split(self.dim_len, self.world)
        object.__setattr__(self, "local_lens", lengths)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "padded_len", padded_len)
        per_row = self.tokens_per_row
        object.__setattr__(self, "tokens_per_rank", tuple(n * per_row for n in lengths))

    @classmethod
    def from_shape(
        cls, batch_size: int, seq_len: int, world: int, shard_dim: ShardDim | None
    ) -> TokenShardMeta:
        """Metadata for a global ``(batch_size, seq_len, D)`` activation split ``world`` ways."""
        return cls(batch_size=batch_size, seq_len=seq_len, world=world, shard_dim=shard_dim)

    # -- global quantities ------------------------------------------------------------------

    @property
    def dim_len(self) -> int:
        """``n``: the global extent of the sharded dim (``L``, ``B`` or ``B * L``)."""
        if self.shard_dim == 1:
            return self.seq_len
        if self.shard_dim == 0:
            return self.batch_size
        return self.batch_size * self.seq_len

    @property
    def tokens_per_row(self) -> int:
        """Tokens per unit of the sharded dim: ``B`` for ``Shard(1)``, ``L`` for ``Shard(0)``."""
        if self.shard_dim == 1:
            return self.batch_size
        if self.shard_dim == 0:
            return self.seq_len
        return 1

    @property
    def tensor_dim(self) -> int:
        """The dim of the local tensor that is split: 1 for ``Shard(1)``, else 0."""
        return 1 if self.shard_dim == 1 else 0

    @property
    def total_tokens(self) -> int:
        """``B * L``: real tokens over all ranks."""
        return self.batch_size * self.seq_len

    @property
    def padded_tokens(self) -> int:
        """``T_P``: tokens of one rank's padded block, the same on every rank."""
        return self.padded_len * self.tokens_per_row

    # -- per-rank quantities ----------------------------------------------------------------

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(
                f"TokenShardMeta: rank must be an int in [0, {self.world}) for world={self.world}, "
                f"got rank={rank!r}"
            )
        return rank

    def local_len(self, rank: int) -> int:
        """``l_r``: real length of ``rank`` along the sharded dim (may be 0)."""
        return self.local_lens[self._check_rank(rank)]

    def offset(self, rank: int) -> int:
        """Global offset of ``rank``'s shard along the sharded dim (``n`` for an empty shard)."""
        return self.offsets[self._check_rank(rank)]

    def num_tokens(self, rank: int) -> int:
        """``T_r``: real tokens on ``rank`` (batch-aware: ``B * l_r`` for ``Shard(1)``)."""
        return self.tokens_per_rank[self._check_rank(rank)]

    def global_token_index(
        self, rank: int, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Index into the flattened global ``(B * L)`` tokens of each real local token.

        Returns:
            ``idx_T`` (int64, shape ``(T_r,)``), in the order of the flattened *unpadded* local
            shard: ``(b, l)`` for ``Shard(1)``, where ``idx = b * L + offset_r + l``;
            ``(b_local, l)`` for ``Shard(0)``, where ``idx = (offset_r + b_local) * L + l``;
            ``t`` for ``"flat"``, where ``idx = offset_r + t``.
        """
        length, start = self.local_len(rank), self.offset(rank)
        if self.shard_dim == 1:
            rows_B1 = torch.arange(self.batch_size, device=device).unsqueeze(1) * self.seq_len
            cols_1l = torch.arange(start, start + length, device=device).unsqueeze(0)
            return (rows_B1 + cols_1l).reshape(-1)
        per_row = self.tokens_per_row
        return torch.arange(start * per_row, (start + length) * per_row, device=device)

    def valid_mask(self, rank: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Which rows of ``rank``'s padded, flattened local block hold real tokens.

        Returns:
            ``mask_TP`` (bool, shape ``(T_P,)``) in the flattened order of the padded local
            block: ``(b, p)`` with ``p < P`` for ``Shard(1)``, ``(p, l)`` for ``Shard(0)``, ``p``
            for ``"flat"``. ``mask_TP.sum() == num_tokens(rank)``. Padding rows (``False``) must
            not be routed nor counted in router statistics; see Note [Virtual padding].
        """
        real_P = torch.arange(self.padded_len, device=device) < self.local_len(rank)
        if self.shard_dim == 1:
            return real_P.expand(self.batch_size, self.padded_len).reshape(-1)
        if self.shard_dim == 0:
            return real_P.unsqueeze(1).expand(self.padded_len, self.seq_len).reshape(-1)
        return real_P

    # -- pad / unpad around a collective ----------------------------------------------------

    def _resolve_dim(self, x: torch.Tensor, dim: int | None) -> int:
        dim = self.tensor_dim if dim is None else dim
        if not -x.dim() <= dim < x.dim():
            raise ValueError(
                f"TokenShardMeta: dim={dim} is out of range for a tensor of shape "
                f"{tuple(x.shape)}"
            )
        return dim % x.dim()

    def pad(self, x_local: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """Zero-pad a local shard up to ``padded_len`` along ``dim``.

        Args:
            x_local: this rank's real shard, e.g. ``(B, l_r, D)`` for ``Shard(1)``.
            dim: the split dim of ``x_local``; defaults to :attr:`tensor_dim`.

        Returns:
            ``x_local`` itself when it already has ``padded_len`` rows, else a new tensor of
            ``padded_len`` rows whose tail is zeros. Autograd gives ``x_local`` the slice of the
            padded gradient that belongs to its real rows. No collective runs.
        """
        dim = self._resolve_dim(x_local, dim)
        length = x_local.size(dim)
        if length > self.padded_len:
            raise ValueError(
                f"TokenShardMeta: x_local has {length} rows along dim {dim} (shape "
                f"{tuple(x_local.shape)}), more than padded_len={self.padded_len} for "
                f"n={self.dim_len} over world={self.world}"
            )
        if length == self.padded_len:
            return x_local
        pad_shape = list(x_local.shape)
        pad_shape[dim] = self.padded_len - length
        return torch.cat([x_local, x_local.new_zeros(pad_shape)], dim=dim)

    def unpad(self, x_padded: torch.Tensor, rank: int, dim: int | None = None) -> torch.Tensor:
        """Cut ``rank``'s padded block back to its real length along ``dim``.

        Args:
            x_padded: a block with ``padded_len`` rows along ``dim``, e.g. the slice of an
                all-gather result that came from ``rank``.
            rank: the rank whose real length to keep.
            dim: the split dim of ``x_padded``; defaults to :attr:`tensor_dim`.

        Returns:
            A ``narrow`` view of the first ``local_len(rank)`` rows. Its backward is exactly zero
            on the padding rows, so padding never receives gradient. No collective runs.
        """
        length = self.local_len(rank)
        dim = self._resolve_dim(x_padded, dim)
        if x_padded.size(dim) != self.padded_len:
            raise ValueError(
                f"TokenShardMeta: x_padded has {x_padded.size(dim)} rows along dim {dim} (shape "
                f"{tuple(x_padded.shape)}), expected padded_len={self.padded_len}"
            )
        return x_padded.narrow(dim, 0, length)
