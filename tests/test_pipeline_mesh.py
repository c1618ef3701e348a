"""``build_moe_meshes(pp=...)`` on 8 gloo ranks: each stage's meshes, the pp mesh, the stage
group, the memo, and the errors raised before any process group exists."""

from __future__ import annotations

import torch.distributed as dist
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
