"""Tests for the virtual-padding metadata (``dtensor_moe.parallel.padding``).

Single-process tests check the split against DTensor's own
``compute_local_shape_and_global_offset`` on a backend-less ``DeviceMesh`` (tests may use private
torch APIs; the library does not). One 4-process gloo test distributes real tensors and runs a
padded all-gather.

Shape legend: B batch, L sequence, D hidden, P padded length, T tokens.
"""

# ruff: noqa: N806

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    with_comms,
)

from dtensor_moe.parallel import padding
from dtensor_moe.parallel.padding import TokenShardMeta

WORLDS = (1, 2, 3, 4)
OTHER_DIMS = (1, 3)  # B for a sequence or flat split, L for a batch split
D = 2


def _cases():
    """(world, B, L, shard_dim) covering every n in 0..2*world+1 for each split kind."""
    for world, other in itertools.product(WORLDS, OTHER_DIMS):
        for n in range(2 * world + 2):
            yield world, other, n, 1  # Shard(1): n = L
            yield world, n, other, 0  # Shard(0): n = B
            yield world, other, n, "flat"  # flat: n = B * L (every n is reached with B = 1)


def _torch_split(meta: TokenShardMeta, rank: int) -> tuple[int, int]:
    """(local length, global offset) along the split dim, from DTensor itself."""
    mesh = DeviceMesh("cpu", torch.arange(meta.world), _init_backend=False, _rank=rank)
    if meta.shard_dim == "flat":
        shape, dim = (meta.batch_size * meta.seq_len, D), 0
    else:
        shape, dim = (meta.batch_size, meta.seq_len, D), meta.shard_dim
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(dim)])
    return local_shape[dim], offset[dim]


def _reference_shard(meta: TokenShardMeta, x_BLD: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s real shard of ``x_BLD``, by direct slicing."""
    off, n = meta.offset(rank), meta.local_len(rank)
    if meta.shard_dim == 1:
        return x_BLD[:, off : off + n]
    if meta.shard_dim == 0:
        return x_BLD[off : off + n]
    return x_BLD.reshape(-1, x_BLD.shape[-1])[off : off + n]


class TokenShardMetaTest(TestCase):
    def test_split_matches_dtensor(self):
        for world, B, L, shard_dim in _cases():
            meta = TokenShardMeta.from_shape(B, L, world, shard_dim)
            for rank in range(world):
                with self.subTest(world=world, B=B, L=L, shard_dim=shard_dim, rank=rank):
                    length, offset = _torch_split(meta, rank)
                    self.assertEqual(meta.local_len(rank), length)
                    self.assertEqual(meta.offset(rank), offset)
                    self.assertLessEqual(length, meta.padded_len)
                    x = torch.empty(B, L, D)
                    self.assertEqual(
                        meta.num_tokens(rank), _reference_shard(meta, x, rank).numel() // D
                    )
            self.assertEqual(meta.padded_len, -(-meta.dim_len // world))
            self.assertEqual(sum(meta.tokens_per_rank), B * L)

    def test_known_splits(self):
        meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        self.assertEqual(meta.local_lens, (2, 2, 2, 1))
        self.assertEqual(meta.offsets, (0, 2, 4, 6))
        self.assertEqual(meta.padded_len, 2)
        self.assertEqual(meta.tokens_per_rank, (4, 4, 4, 2))
        self.assertEqual(meta.padded_tokens, 4)
        # ceil-sized chunks leave a trailing rank empty: 4 over 3 is [2, 2, 0], not [2, 1, 1]
        meta = TokenShardMeta.from_shape(1, 4, 3, shard_dim=1)
        self.assertEqual((meta.local_lens, meta.offsets), ((2, 2, 0), (0, 2, 4)))
        # fewer tokens than ranks
        meta = TokenShardMeta.from_shape(3, 1, 4, shard_dim=0)
        self.assertEqual((meta.local_lens, meta.offsets), ((1, 1, 1, 0), (0, 1, 2, 3)))
        self.assertEqual(meta.tokens_per_rank, (1, 1, 1, 0))
        meta = TokenShardMeta.from_shape(0, 5, 2, shard_dim="flat")
        self.assertEqual((meta.local_lens, meta.padded_len, meta.padded_tokens), ((0, 0), 0, 0))

    def test_none_is_flat_and_frozen(self):
        meta = TokenShardMeta.from_shape(2, 3, 2, None)
        self.assertEqual(meta, TokenShardMeta(batch_size=2, seq_len=3, world=2, shard_dim="flat"))
        self.assertEqual(meta.shard_dim, "flat")
        self.assertEqual(hash(meta), hash(TokenShardMeta.from_shape(2, 3, 2, "flat")))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            meta.world = 4  # type: ignore[misc]

    def test_global_token_index(self):
        for world, B, L, shard_dim in _cases():
            meta = TokenShardMeta.from_shape(B, L, world, shard_dim)
            ids_BL = torch.arange(B * L).reshape(B, L)
            seen = []
            for rank in range(world):
                with self.subTest(world=world, B=B, L=L, shard_dim=shard_dim, rank=rank):
                    idx_T = meta.global_token_index(rank)
                    self.assertEqual(idx_T.dtype, torch.int64)
                    expected = _reference_shard(meta, ids_BL.unsqueeze(-1), rank).reshape(-1)
                    self.assertEqual(idx_T, expected)
                    seen.append(idx_T)
            self.assertEqual(torch.cat(seen).sort().values, torch.arange(B * L))

    def test_global_token_index_is_batch_aware(self):
        # Shard(1), B = 2, L = 5 over 2 ranks: rank 1 holds l in [3, 5) of both sequences.
        meta = TokenShardMeta.from_shape(2, 5, 2, shard_dim=1)
        self.assertEqual(meta.global_token_index(1), torch.tensor([3, 4, 8, 9]))
        naive = torch.arange(meta.num_tokens(1)) + meta.num_tokens(0) * 1
        self.assertNotEqual(meta.global_token_index(1), naive)

    def test_valid_mask_selects_real_rows(self):
        for world, B, L, shard_dim in _cases():
            meta = TokenShardMeta.from_shape(B, L, world, shard_dim)
            x_BLD = torch.randn(B, L, D)
            for rank in range(world):
                with self.subTest(world=world, B=B, L=L, shard_dim=shard_dim, rank=rank):
                    x_local = _reference_shard(meta, x_BLD, rank)
                    x_pad_TD = meta.pad(x_local).reshape(-1, D)
                    mask_TP = meta.valid_mask(rank)
                    self.assertEqual(mask_TP.dtype, torch.bool)
                    self.assertEqual(mask_TP.shape, (meta.padded_tokens,))
                    self.assertEqual(int(mask_TP.sum()), meta.num_tokens(rank))
                    self.assertEqual(x_pad_TD[mask_TP], x_local.reshape(-1, D))
                    self.assertTrue(bool((x_pad_TD[~mask_TP] == 0).all()))
                    idx = x_BLD.reshape(-1, D)[meta.global_token_index(rank)]
                    self.assertEqual(x_pad_TD[mask_TP], idx)

    def test_pad_unpad_round_trip(self):
        # What a padded all-gather does: every rank contributes P rows, the receiver unpads.
        for world, B, L, shard_dim in _cases():
            meta = TokenShardMeta.from_shape(B, L, world, shard_dim)
            x_BLD = torch.randn(B, L, D)
            dim = meta.tensor_dim
            blocks = [meta.pad(_reference_shard(meta, x_BLD, r)) for r in range(world)]
            with self.subTest(world=world, B=B, L=L, shard_dim=shard_dim):
                self.assertTrue(all(b.size(dim) == meta.padded_len for b in blocks))
                gathered = torch.cat(blocks, dim=dim)  # equal sizes on every rank
                chunks = gathered.split(meta.padded_len, dim=dim) if meta.padded_len else blocks
                full = torch.cat([meta.unpad(c, r) for r, c in enumerate(chunks)], dim=dim)
                self.assertEqual(full, x_BLD.reshape(full.shape))

    def test_pad_explicit_dim_and_no_copy(self):
        meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        x_lBD = torch.randn(1, 2, D)  # split dim first
        self.assertEqual(meta.pad(x_lBD, dim=0).shape, (2, 2, D))
        self.assertEqual(meta.unpad(meta.pad(x_lBD, dim=0), 3, dim=-3), x_lBD)
        full = torch.randn(2, 2, D)
        self.assertIs(meta.pad(full), full)

    def test_padding_gets_no_gradient(self):
        meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        # unpad: the padding rows of the padded block get exactly zero gradient
        x_pad = torch.randn(2, meta.padded_len, D, requires_grad=True)
        meta.unpad(x_pad, 3).mul(3.0).sum().backward()
        expected = torch.zeros_like(x_pad)
        expected[:, : meta.local_len(3)] = 3.0
        self.assertEqual(x_pad.grad, expected)
        # pad: the real rows get the matching slice of the padded gradient
        x_local = torch.randn(2, meta.local_len(3), D, requires_grad=True)
        weight = torch.randn(2, meta.padded_len, D)
        (meta.pad(x_local) * weight).sum().backward()
        self.assertEqual(x_local.grad, weight[:, : meta.local_len(3)])
        # a rank with zero real tokens gets zero gradient everywhere
        meta = TokenShardMeta.from_shape(2, 4, 3, shard_dim=1)
        x_pad = torch.randn(2, meta.padded_len, D, requires_grad=True)
        (meta.unpad(x_pad, 2).sum() + 0.0 * x_pad.sum()).backward()
        self.assertEqual(x_pad.grad, torch.zeros_like(x_pad))

    def test_library_uses_public_torch_api_only(self):
        tree = ast.parse(inspect.getsource(padding))
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        private = [
            m for m in modules if m != "__future__" and any(p[:1] == "_" for p in m.split("."))
        ]
        self.assertEqual(private, [], "only dtensor_moe/_compat.py may import torch internals")

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, r"must be >= 0, got batch_size=-1, seq_len=4"):
            TokenShardMeta.from_shape(-1, 4, 2, 1)
        with self.assertRaisesRegex(ValueError, r"got batch_size=2, seq_len=-3"):
            TokenShardMeta.from_shape(2, -3, 2, 1)
        with self.assertRaisesRegex(ValueError, r"world must be >= 1, got world=0"):
            TokenShardMeta.from_shape(2, 4, 0, 1)
        with self.assertRaisesRegex(TypeError, r"seq_len must be an int, got 4.0"):
            TokenShardMeta.from_shape(2, 4.0, 2, 1)  # type: ignore[arg-type]
        for bad in (2, -1, "seq", True, Shard(1)):
            pattern = r"shard_dim must be 0 .* got " + re.escape(repr(bad)) + "; for a Shard"
            with self.assertRaisesRegex(ValueError, pattern):
                TokenShardMeta.from_shape(2, 4, 2, bad)  # type: ignore[arg-type]
        meta = TokenShardMeta.from_shape(2, 5, 2, shard_dim=1)
        for rank in (-1, 2):
            for method in (meta.local_len, meta.offset, meta.num_tokens, meta.valid_mask):
                with self.assertRaisesRegex(
                    ValueError, rf"rank must be an int in \[0, 2\) for world=2, got rank={rank}"
                ):
                    method(rank)
            with self.assertRaisesRegex(ValueError, rf"got rank={rank}"):
                meta.global_token_index(rank)
            with self.assertRaisesRegex(ValueError, rf"got rank={rank}"):
                meta.unpad(torch.zeros(2, 3, D), rank)
        with self.assertRaisesRegex(
            ValueError,
            r"x_local has 4 rows along dim 1 \(shape \(2, 4, 2\)\), more than padded_len=3 "
            r"for n=5 over world=2",
        ):
            meta.pad(torch.zeros(2, 4, D))
        with self.assertRaisesRegex(
            ValueError,
            r"x_padded has 2 rows along dim 1 \(shape \(2, 2, 2\)\), expected padded_len=3",
        ):
            meta.unpad(torch.zeros(2, 2, D), 0)
        with self.assertRaisesRegex(ValueError, r"dim=3 is out of range for .* \(2, 3, 2\)"):
            meta.pad(torch.zeros(2, 3, D), dim=3)


class TokenShardMetaDistributedTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_matches_distribute_tensor_and_padded_all_gather(self):
        mesh = DeviceMesh(self.device_type, torch.arange(self.world_size))
        rank = self.rank
        for B, L, shard_dim in ((2, 7, 1), (1, 2, 1), (3, 5, 0), (3, 5, "flat"), (1, 3, "flat")):
            meta = TokenShardMeta.from_shape(B, L, self.world_size, shard_dim)
            torch.manual_seed(0)
            x_BLD = torch.randn(B, L, D)
            if shard_dim == "flat":
                x_global, placement = x_BLD.reshape(B * L, D), Shard(0)
            else:
                x_global, placement = x_BLD, Shard(shard_dim)
            x_local = distribute_tensor(x_global, mesh, [placement]).to_local()
            dim = meta.tensor_dim
            self.assertEqual(x_local.size(dim), meta.local_len(rank))
            self.assertEqual(x_local, _reference_shard(meta, x_BLD, rank).reshape(x_local.shape))
            self.assertEqual(
                x_local.reshape(-1, D), x_BLD.reshape(-1, D)[meta.global_token_index(rank)]
            )
            # padded all-gather: equal sizes on every rank, unpad each block
            x_pad = meta.pad(x_local).movedim(dim, 0).contiguous()
            gathered = x_pad.new_empty((self.world_size * x_pad.size(0), *x_pad.shape[1:]))
            dist.all_gather_into_tensor(gathered, x_pad)
            blocks = gathered.view(self.world_size, *x_pad.shape).unbind(0)
            full = torch.cat([meta.unpad(b, r, dim=0) for r, b in enumerate(blocks)])
            full = full.movedim(0, dim)
            self.assertEqual(full, x_global)


if __name__ == "__main__":
    run_tests()
