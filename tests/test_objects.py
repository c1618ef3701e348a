"""Note [Object collectives without numpy]: ``all_gather_objects`` works where torch's
``all_gather_object`` needs numpy, and ``ExpertParallel`` applies without numpy."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import ExpertParallel, MoE, MoEConfig
from dtensor_moe.parallel.objects import all_gather_objects
from tests._dist import DistTestBase


def _no_numpy(self, *args, **kwargs):
    raise RuntimeError("Numpy is not available")


class AllGatherObjectsTest(DistTestBase):
    @with_comms
    def test_objects_of_different_sizes_in_rank_order(self):
        mine = {"rank": self.rank, "text": "x" * (7 * self.rank + 1), "t": (self.rank, None)}
        with CommDebugMode() as comm:
            got = all_gather_objects(mine)
        want = [{"rank": r, "text": "x" * (7 * r + 1), "t": (r, None)} for r in range(4)]
        self.assertEqual(got, want)
        self.assertEqual(comm.get_total_counts(), 2)  # sizes, then the padded pickles

    @with_comms
    def test_subgroup_and_one_rank_group(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        got = all_gather_objects(("b", self.rank), mesh.get_group("b"), mesh.device_type)
        first = self.rank - self.rank % 2
        self.assertEqual(got, [("b", first), ("b", first + 1)])
        solo = dist.new_group([self.rank], use_local_synchronization=True)
        with CommDebugMode() as comm:
            self.assertEqual(all_gather_objects("only", solo), ["only"])
        self.assertEqual(comm.get_total_counts(), 0)

    @with_comms
    def test_works_where_torchs_object_collective_needs_numpy(self):
        # torch 2.13's all_gather_object reads the bytes back through Tensor.numpy(): without
        # numpy it fails. That is why dtensor_moe has its own (the workaround is needed).
        with mock.patch.object(torch.Tensor, "numpy", _no_numpy):
            with self.assertRaisesRegex(RuntimeError, "Numpy is not available"):
                out = [None] * self.world_size
                dist.all_gather_object(out, self.rank)
            self.assertEqual(all_gather_objects(self.rank), [0, 1, 2, 3])
            # applying ExpertParallel (its config check gathers objects) needs no numpy either
            torch.manual_seed(0)
            moe = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2))
            mesh = init_device_mesh("cpu", (4,))
            parallelize_module(moe, mesh, {"experts": ExpertParallel()})
        self.assertEqual(moe.experts.w1.to_local().shape[0], 1)


if __name__ == "__main__":
    run_tests()
