"""The package's caches keep no mesh, process group or optimizer alive (one process, gloo).

A world of one rank runs what fills every cache: ``build_moe_meshes``, a token-parallel MoE
forward and backward (``local_views``, the checked-dispatcher cache), and GradScaler steps of a
fused AdamW over the DTensor params (the inf-check handler, the fused handlers).
Then the default group is destroyed and the objects deleted: weak references to all of them must
be dead after ``gc.collect()``, with and without ``dtensor_moe.clear_caches()``.

torch 2.13 keeps meshes in caches of its own (sharding propagation,
``torch.distributed.tensor._redistribute``'s transform-info and planner caches, which hold the
meshes of every spec they have seen, and the ``MeshTopoInfo.build_from_mesh`` cache of the
redistribution cost model, which sharding propagation fills when DTensor ops run on a mesh);
the tests empty those, so that what is left is ours.
"""

from __future__ import annotations

import gc
import unittest
import weakref

import torch
import torch.distributed as dist
import torch.distributed.tensor._redistribute as torch_redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_moe
from dtensor_moe import (
    ExpertTensorParallel,
    MoE,
    MoEConfig,
    PrepareMoEInput,
    build_moe_meshes,
)
from dtensor_moe import _compat
from dtensor_moe.parallel import mesh as mesh_module


def _clear_torch_caches() -> None:
    _compat.clear_sharding_prop_cache()
    torch_redistribute._gen_transform_infos.cache_clear()
    torch_redistribute._planner_cache.clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _train() -> tuple[dict[str, weakref.ref], list[str]]:
    """Fill the caches; returns weak references to what must not outlive the caller's ``del``,
    and the names of the caches that stayed empty."""
    meshes = build_moe_meshes(dp=1, ep=1, tp=1)
    tp = meshes.dense["tp"]
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=2, top_k=1, num_shared_experts=1,
                        shared_hidden_dim=8))
    parallelize_module(moe.experts, tp, ExpertTensorParallel())
    parallelize_module(moe, tp, PrepareMoEInput(input_layout=Shard(1)))
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = distribute_tensor(torch.randn(2, 3, 8), tp, [Shard(1)])
    for _ in range(2):
        loss = moe(x).to_local().square().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    filled = {
        "_compat._GRAD_SPECS": len(_compat._GRAD_SPECS),
        "mesh._BUILT": len(mesh_module._BUILT),
    }
    refs = {
        "optimizer": weakref.ref(opt),
        "moe": weakref.ref(moe),
        "dense mesh": weakref.ref(meshes.dense),
        "expert mesh": weakref.ref(meshes.expert),
        "tp mesh": weakref.ref(tp),
        "default group": weakref.ref(dist.group.WORLD),
        "tp group": weakref.ref(tp.get_group()),
    }
    return refs, [name for name, size in filled.items() if size == 0]


class CachesReleaseObjectsTest(unittest.TestCase):
    def _survivors(self, clear_caches: bool) -> list[str]:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            refs, empty = _train()
        finally:
            dist.destroy_process_group()
        self.assertEqual(empty, [], "the run must go through every cache it checks")
        if clear_caches:
            dtensor_moe.clear_caches()
        _clear_torch_caches()
        gc.collect()
        return [name for name, ref in refs.items() if ref() is not None]

    def test_released_without_clear_caches(self):
        self.assertEqual(self._survivors(clear_caches=False), [])

    def test_released_with_clear_caches(self):
        self.assertEqual(self._survivors(clear_caches=True), [])

    def test_mesh_memo_reuses_live_meshes_only(self):
        """Note [Mesh memo]: the same meshes while they live and under the same default group."""
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            first = build_moe_meshes(dp=1, ep=1, tp=1)
            dense, expert_ref = first.dense, weakref.ref(first.expert)
            self.assertIs(build_moe_meshes(dp=1, ep=1, tp=1).expert, first.expert)
            del first
            gc.collect()
            self.assertIsNone(expert_ref())  # the memo did not keep it
            again = build_moe_meshes(dp=1, ep=1, tp=1)
            self.assertIs(again.dense, dense)  # still alive: reused
            self.assertEqual(again.expert.mesh_dim_names, ("edp", "ep", "etp"))  # rebuilt
        finally:
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            fresh = build_moe_meshes(dp=1, ep=1, tp=1)  # a new default group: new meshes
            self.assertIsNot(fresh.dense, dense)
        finally:
            dist.destroy_process_group()

if __name__ == "__main__":
    unittest.main()
