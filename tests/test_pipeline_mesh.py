"""``build_moe_meshes(pp=...)`` on 8 gloo ranks: each stage's meshes, the pp mesh, the stage
group, the memo, and the errors raised before any process group exists; 16 and 32 ranks in one
process on the fake process group."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes
from tests._dist import DistTestBase
from tests.test_parallel_mesh import _groups, _my_group

# (kwargs, stage-0 dense groups, stage-0 expert groups); stage s adds s * (dp * tp) to each rank
CASES = [
    (
        dict(pp=2, dp=4, ep=2),  # pp2 x dp4, EP2 over dp
        {"dp": [[0, 1, 2, 3]], "tp": [[0], [1], [2], [3]]},
        {"edp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
    (
        dict(pp=2, dp=2, ep=2, tp=2, expert_tp=True),  # pp2 x (EP2 x TP2)
        {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
        {"edp": [[0], [1], [2], [3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]]},
    ),
    (
        dict(pp=2, dp=2, ep=2, tp=2),  # pp2 x SP2, EP borrows TP
        {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
        {"edp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]]},
    ),
    (
        dict(pp=4, dp=2, ep=2),  # pp4 x dp2ep2
        {"dp": [[0, 1]], "tp": [[0], [1]]},
        {"edp": [[0], [1]], "ep": [[0, 1]], "etp": [[0], [1]]},
    ),
    (
        dict(pp=8, dp=1, ep=1),  # one rank per stage
        {"dp": [[0]], "tp": [[0]]},
        {"edp": [[0]], "ep": [[0]], "etp": [[0]]},
    ),
]

# CI: the first, fourth and fifth cases (EP over dp ranks at pp2, pp4, pp8). The EP x TP and
# SP layouts inside a stage are the groups that tests/test_parallel_mesh.py checks on 4 gloo
# ranks, and their stage offsets are those that test_large_layouts_in_one_process checks at 16
# and 32 ranks (tp, expert tp); DTENSOR_MOE_FULL_MATRIX=1 runs them here too.
if os.environ.get("DTENSOR_MOE_FULL_MATRIX") != "1":
    CASES = [CASES[0], *CASES[3:]]

ERRORS = [
    (dict(pp=3, dp=2, ep=1), r"pp must divide the world size, got pp=3 for world size 8"),
    (dict(pp=0, dp=8, ep=1), r"pp must be an int >= 1, got pp=0"),
    (dict(pp=True, dp=8, ep=1), r"pp must be an int >= 1, got pp=True"),
    (dict(pp=2.0, dp=4, ep=1), r"pp must be an int >= 1, got pp=2.0"),
    (
        dict(pp=2, dp=2, ep=1),
        r"pp \* dp \* tp must equal the world size, got pp=2, dp=2, tp=1 \(pp \* dp \* tp = 4\) "
        r"for world size 8; choose dp = 4 // tp",
    ),
    (dict(pp=2, dp=4, ep=3), r"ep must divide dp; got ep=3, dp=4"),
    (
        dict(pp=2, dp=1, ep=2, tp=4),
        r"divide the ranks of a stage \(dp \* tp\); got ep=2, tp=4, world=4; use ep in \[4\]",
    ),
]


# (world, kwargs, ranks) -> for a few ranks: (stage ranks, pp peers, ep group, dense tp group)
LARGE = [
    (16, dict(pp=2, dp=2, ep=4, tp=4), {
        0: ((0, 8), [0, 8], [0, 1, 2, 3], [0, 1, 2, 3]),
        13: ((8, 16), [5, 13], [12, 13, 14, 15], [12, 13, 14, 15]),
    }),
    (32, dict(pp=4, dp=4, ep=4, tp=2, expert_tp=True), {
        0: ((0, 8), [0, 8, 16, 24], [0, 2, 4, 6], [0, 1]),
        29: ((24, 32), [5, 13, 21, 29], [25, 27, 29, 31], [28, 29]),
    }),
]


@pytest.mark.parametrize(("world", "kwargs", "ranks"), LARGE)
def test_large_layouts_in_one_process(world, kwargs, ranks):
    """Layouts beyond this machine, one rank at a time on torch's fake process group (which
    runs no collective: group memberships only)."""
    for rank, (stage, peers, ep, tp) in ranks.items():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            meshes = build_moe_meshes(**kwargs, device_type="cpu")
            assert meshes.stage_ranks == tuple(range(*stage))
            assert sorted(dist.get_process_group_ranks(meshes.stage_group)) == list(range(*stage))
            assert meshes.pp_mesh.mesh.tolist() == peers
            assert sorted(dist.get_process_group_ranks(meshes.expert.get_group("ep"))) == ep
            assert sorted(dist.get_process_group_ranks(meshes.dense.get_group("tp"))) == tp
            assert meshes.edp * meshes.ep * meshes.etp == world // kwargs["pp"]
        finally:
            dist.destroy_process_group()


class PipelineMeshesTest(DistTestBase):
    WORLD_SIZE = 8

    @with_comms
    def test_stage_meshes_memberships_and_errors(self):
        for kwargs, dense, expert in CASES:
            meshes = build_moe_meshes(**kwargs, device_type=self.device_type)
            pp, stage = kwargs["pp"], self.world_size // kwargs["pp"]
            offset = (self.rank // stage) * stage
            self.assertEqual((meshes.pp, meshes.pp_rank), (pp, self.rank // stage), kwargs)
            self.assertEqual(meshes.stage_ranks, tuple(range(offset, offset + stage)), kwargs)
            self.assertEqual(
                sorted(dist.get_process_group_ranks(meshes.stage_group)),
                list(meshes.stage_ranks),
                kwargs,
            )
            self.assertEqual(meshes.pp_mesh.mesh_dim_names, ("pp",), kwargs)
            peers = [self.rank % stage + s * stage for s in range(pp)]
            self.assertEqual(meshes.pp_mesh.mesh.tolist(), peers, kwargs)
            self.assertEqual(_my_group(meshes.pp_mesh, "pp"), peers, kwargs)
            self.assertEqual(meshes.dense.mesh_dim_names, ("dp", "tp"), kwargs)
            self.assertEqual(meshes.expert.mesh_dim_names, ("edp", "ep", "etp"), kwargs)
            for mesh, want in ((meshes.dense, dense), (meshes.expert, expert)):
                for dim, groups in want.items():
                    groups = [[r + offset for r in g] for g in groups]
                    self.assertEqual(_groups(mesh, dim), groups, f"{kwargs} {dim}")
                    mine = next(g for g in groups if self.rank in g)
                    self.assertEqual(_my_group(mesh, dim), mine, f"{kwargs} {dim}")
            self.assertEqual(meshes.edp * meshes.ep * meshes.etp, stage, kwargs)
            # Note [One mesh per layout]: the same meshes and the same groups again
            again = build_moe_meshes(**kwargs, device_type=self.device_type)
            self.assertIs(again.dense, meshes.dense, kwargs)
            self.assertIs(again.expert, meshes.expert, kwargs)
            self.assertIs(again.stage_group, meshes.stage_group, kwargs)
            self.assertEqual(again, meshes, kwargs)
            self.assertIs(again.pp_mesh.get_group(), meshes.pp_mesh.get_group(), kwargs)

        # pp=1 is the layout without pp: the whole world is one stage
        flat = build_moe_meshes(dp=8, ep=2, device_type=self.device_type)
        self.assertIs(build_moe_meshes(pp=1, dp=8, ep=2, device_type=self.device_type).dense,
                      flat.dense)
        self.assertEqual((flat.pp, flat.pp_rank, flat.pp_mesh), (1, 0, None))
        self.assertEqual(flat.stage_ranks, tuple(range(8)))
        self.assertIs(flat.stage_group, dist.group.WORLD)
        self.assertEqual(flat.dense.mesh.tolist(), [[r] for r in range(8)])

        for kwargs, pattern in ERRORS:
            with self.assertRaisesRegex(ValueError, pattern, msg=str(kwargs)):
                build_moe_meshes(**kwargs, device_type=self.device_type)
        dist.barrier()  # every rank raised before creating a group: the world is still in step


if __name__ == "__main__":
    run_tests()
