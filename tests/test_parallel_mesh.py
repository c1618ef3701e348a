"""Tests of ``build_moe_meshes`` (4 gloo ranks): group memberships and early errors."""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoEMeshes, build_moe_meshes
from tests._dist import DistTestBase


def _groups(mesh, dim: str) -> list[list[int]]:
    """All groups of ``mesh`` along ``dim``, as sorted rank lists (same on every rank)."""
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index(dim), -1)
    return sorted(ranks.reshape(-1, ranks.shape[-1]).tolist())


def _my_group(mesh, dim: str) -> list[int]:
    return sorted(dist.get_process_group_ranks(mesh.get_group(dim)))


# (kwargs, dense dp/tp groups, expert edp/ep/etp groups)
CASES = [
    (
        dict(dp=4, ep=4),  # EP4, dp2ep
        {"dp": [[0, 1, 2, 3]], "tp": [[0], [1], [2], [3]]},
        {"edp": [[0], [1], [2], [3]], "ep": [[0, 1, 2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
    (
        dict(dp=4, ep=2),  # EP2 over dp, edp 2
        {"dp": [[0, 1, 2, 3]], "tp": [[0], [1], [2], [3]]},
        {"edp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
    (
        dict(dp=2, ep=2, tp=2, expert_tp=True),  # EP2 x TP2
        {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
        {"edp": [[0], [1], [2], [3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]]},
    ),
    (
        dict(dp=1, ep=1, tp=4, expert_tp=True),  # expert TP4
        {"dp": [[0], [1], [2], [3]], "tp": [[0, 1, 2, 3]]},
        {"edp": [[0], [1], [2], [3]], "ep": [[0], [1], [2], [3]], "etp": [[0, 1, 2, 3]]},
    ),
    (
        dict(dp=2, ep=2, tp=2),  # SP2 with EP borrowing TP
        {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
        {"edp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
    (
        dict(dp=2, ep=4, tp=2),  # EP4 borrowing TP and dp
        {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
        {"edp": [[0], [1], [2], [3]], "ep": [[0, 1, 2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
]

ERRORS = [
    (dict(dp=2, ep=2), r"dp \* tp must equal the world size, got dp=2, tp=1 .* world size 4"),
    (dict(dp=4, ep=3), r"ep must divide dp; got ep=3, dp=4"),
    (dict(dp=2, ep=4, tp=2, expert_tp=True), r"expert_tp=True.*ep must divide dp; got ep=4, dp=2"),
    (
        dict(dp=1, ep=2, tp=4),
        r"ep must be a multiple of tp .* got ep=2, tp=4, world=4; use ep in \[4\]",
    ),
    (dict(dp=2, ep=1, tp=2), r"multiple of tp .* got ep=1, tp=2.* or expert_tp=True"),
    (dict(dp=0, ep=1), r"dp must be an int >= 1, got dp=0"),
    (dict(dp=4, ep=1, expert_tp=1), r"expert_tp must be a bool, got 1"),
]


class BuildMoEMeshesTest(DistTestBase):
    @with_comms
    def test_group_memberships_and_errors(self):
        for kwargs, dense, expert in CASES:
            meshes = build_moe_meshes(**kwargs, device_type=self.device_type)
            self.assertIsInstance(meshes, MoEMeshes)
            self.assertEqual(meshes.dense.mesh_dim_names, ("dp", "tp"), kwargs)
            self.assertEqual(meshes.expert.mesh_dim_names, ("edp", "ep", "etp"), kwargs)
            for mesh, want in ((meshes.dense, dense), (meshes.expert, expert)):
                for dim, groups in want.items():
                    self.assertEqual(_groups(mesh, dim), groups, f"{kwargs} {dim}")
                    mine = next(g for g in groups if self.rank in g)
                    self.assertEqual(_my_group(mesh, dim), mine, f"{kwargs} {dim} rank {self.rank}")
            self.assertEqual(meshes.edp * meshes.ep * meshes.etp, self.world_size, kwargs)
        # a second call returns the same (live) meshes; one case suffices, since the memo is
        # keyed by the arguments and each lookup runs gc.collect() (Note [Mesh memo])
        again = build_moe_meshes(**kwargs, device_type=self.device_type)
        self.assertEqual(again, meshes, kwargs)
        self.assertIs(again.dense, meshes.dense, f"{kwargs}: Note [One mesh per layout]")
        self.assertIs(again.expert, meshes.expert, f"{kwargs}: Note [One mesh per layout]")
        for kwargs, pattern in ERRORS:
            with self.assertRaisesRegex((ValueError, TypeError), pattern, msg=str(kwargs)):
                build_moe_meshes(**kwargs, device_type=self.device_type)
        dist.barrier()  # every rank raised before creating a group: the world is still in step


if __name__ == "__main__":
    run_tests()
