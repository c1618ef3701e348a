"""Tests for the uneven-split metadata (``dtensor_moe.parallel.padding``).

Single-process tests check the split against DTensor's own
``compute_local_shape_and_global_offset`` on a backend-less ``DeviceMesh`` (tests may use private
torch APIs). One 4-process gloo test distributes real tensors and checks that DTensor's own
all-gather of uneven shards (which pads them, Note [Virtual padding]) gives the whole tensor.

Shape legend: B batch, L sequence, D hidden, T tokens.
"""

# ruff: noqa: N806

from __future__ import annotations

import dataclasses
import itertools
import re

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe.parallel.padding import TokenShardMeta
from tests._dist import DistTestBase

WORLDS = (1, 2, 3, 4)
OTHER_DIMS = (1, 3)  # B for a sequence or flat split
D = 2


def _cases():
    """(world, B, L, shard_dim) covering every n in 0..2*world+1 for each split kind."""
    for world, other in itertools.product(WORLDS, OTHER_DIMS):
        for n in range(2 * world + 2):
            yield world, other, n, 1  # Shard(1): n = L
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
                    self.assertLessEqual(length, -(-meta.dim_len // world))  # DTensor's chunk
            self.assertEqual(sum(meta.local_lens), meta.dim_len)

    def test_known_splits(self):
        meta = TokenShardMeta.from_shape(2, 7, 4, shard_dim=1)
        self.assertEqual(meta.local_lens, (2, 2, 2, 1))
        self.assertEqual(meta.offsets, (0, 2, 4, 6))
        # ceil-sized chunks leave a trailing rank empty: 4 over 3 is [2, 2, 0], not [2, 1, 1]
        meta = TokenShardMeta.from_shape(1, 4, 3, shard_dim=1)
        self.assertEqual((meta.local_lens, meta.offsets), ((2, 2, 0), (0, 2, 4)))
        # fewer tokens than ranks
        meta = TokenShardMeta.from_shape(1, 3, 4, shard_dim="flat")
        self.assertEqual((meta.local_lens, meta.offsets), ((1, 1, 1, 0), (0, 1, 2, 3)))
        meta = TokenShardMeta.from_shape(0, 5, 2, shard_dim="flat")
        self.assertEqual((meta.local_lens, meta.offsets), ((0, 0), (0, 0)))

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
        naive = torch.arange(4) + 6 * 1  # local_idx + T_local(rank 0) * rank
        self.assertNotEqual(meta.global_token_index(1), naive)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, r"must be >= 0, got batch_size=-1, seq_len=4"):
            TokenShardMeta.from_shape(-1, 4, 2, 1)
        with self.assertRaisesRegex(ValueError, r"got batch_size=2, seq_len=-3"):
            TokenShardMeta.from_shape(2, -3, 2, 1)
        with self.assertRaisesRegex(ValueError, r"world must be >= 1, got world=0"):
            TokenShardMeta.from_shape(2, 4, 0, 1)
        with self.assertRaisesRegex(TypeError, r"seq_len must be an int, got 4.0"):
            TokenShardMeta.from_shape(2, 4.0, 2, 1)  # type: ignore[arg-type]
        for bad in (0, 2, -1, "seq", True, Shard(1)):
            pattern = r"shard_dim must be 1 .* got " + re.escape(repr(bad)) + "; for a Shard"
            with self.assertRaisesRegex(ValueError, pattern):
                TokenShardMeta.from_shape(2, 4, 2, bad)  # type: ignore[arg-type]
        meta = TokenShardMeta.from_shape(2, 5, 2, shard_dim=1)
        for rank in (-1, 2):
            for method in (meta.local_len, meta.offset):
                with self.assertRaisesRegex(
                    ValueError, rf"rank must be an int in \[0, 2\) for world=2, got rank={rank}"
                ):
                    method(rank)
            with self.assertRaisesRegex(ValueError, rf"got rank={rank}"):
                meta.global_token_index(rank)


class TokenShardMetaDistributedTest(DistTestBase):
    @with_comms
    def test_matches_distribute_tensor_and_dtensor_pads_its_all_gather(self):
        mesh = DeviceMesh(self.device_type, torch.arange(self.world_size))
        rank = self.rank
        for B, L, shard_dim in ((2, 7, 1), (1, 2, 1), (3, 5, "flat"), (1, 3, "flat")):
            meta = TokenShardMeta.from_shape(B, L, self.world_size, shard_dim)
            torch.manual_seed(0)
            x_BLD = torch.randn(B, L, D)
            if shard_dim == "flat":
                x_global, placement = x_BLD.reshape(B * L, D), Shard(0)
            else:
                x_global, placement = x_BLD, Shard(shard_dim)
            x_dt = distribute_tensor(x_global, mesh, [placement])
            x_local = x_dt.to_local()
            self.assertEqual(x_local.size(1 if shard_dim == 1 else 0), meta.local_len(rank))
            self.assertEqual(x_local, _reference_shard(meta, x_BLD, rank).reshape(x_local.shape))
            self.assertEqual(
                x_local.reshape(-1, D), x_BLD.reshape(-1, D)[meta.global_token_index(rank)]
            )
            # Note [Virtual padding]: the library does not pad; DTensor's all-gather of the
            # uneven shards runs one equal-size all_gather_into_tensor and cuts the padding off.
            with CommDebugMode() as comm:
                full = x_dt.redistribute(mesh, [Replicate()]).to_local()
            self.assertEqual(full, x_global)
            counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
            self.assertEqual(counts, {"all_gather_into_tensor": 1})


if __name__ == "__main__":
    run_tests()
