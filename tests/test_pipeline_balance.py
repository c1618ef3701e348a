"""Expert bias and load stats under pipeline parallelism, on 4 gloo ranks: pp2 x dp2 x ep2.

A three-layer model is split into two stages the torchtitan way (a full copy per stage with the
other stage's layers deleted, so the names stay the model's). Two micro-batches run forward
through the stages, stage 0 sending its output to its pp peer, and the counters, the
``load_stats`` figures and the expert biases after ``update_expert_bias`` are compared with one
process running the full model on the same global micro-batches.

Shape legend: B sequences per dp rank, L tokens per sequence, D dim.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, build_moe_meshes
from dtensor_moe.moe import load_stats, update_expert_bias
from dtensor_moe.parallel import parallelize_moe
from tests._dist import DistTestBase
from tests.test_moe_layer import D, make_moe

B, L, MICRO_BATCHES, RATE = 2, 5, 2, 0.125


class Layers(nn.Module):
    """Residual layers in a ModuleDict keyed by their index in the full model."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return x


def full_model(*, dense_first: bool) -> Layers:
    first = nn.Linear(D, D) if dense_first else make_moe(0, num_experts=4, use_expert_bias=True)
    return Layers({
        "0": first,
        "1": make_moe(1, num_experts=8, use_expert_bias=True, num_shared_experts=1),
        "2": make_moe(2, num_experts=4, use_expert_bias=True),
    })


STAGE_LAYERS = (("0",), ("1", "2"))


def stage_module(full: Layers, pp_rank: int) -> Layers:
    stage = copy.deepcopy(full)
    for other in range(len(STAGE_LAYERS)):
        if other != pp_rank:
            for name in STAGE_LAYERS[other]:
                del stage.layers[name]
    return stage


def micro_batch(m: int) -> torch.Tensor:
    return torch.randn(2 * B, L, D, generator=torch.Generator().manual_seed(10 + m))


class PipelineBalanceTest(DistTestBase):
    def _run_pipeline(self, *, dense_first: bool):
        """The meshes, the full reference after the micro-batches, and this rank's stage."""
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        full = full_model(dense_first=dense_first)
        ref = copy.deepcopy(full)
        stage = stage_module(full, meshes.pp_rank)
        if any(isinstance(m, MoE) for m in stage.modules()):
            parallelize_moe(stage, meshes, sequence_parallel=False)
        d = meshes.dense.get_local_rank("dp")
        peer = meshes.pp_mesh.mesh.tolist()[1 - meshes.pp_rank]
        with torch.no_grad():
            for m in range(MICRO_BATCHES):  # counters accumulate over micro-batches
                X = micro_batch(m)
                ref(X)
                if meshes.pp_rank == 0:
                    dist.send(stage(X[d * B : (d + 1) * B]).contiguous(), peer)
                else:
                    x = torch.empty(B, L, D)
                    dist.recv(x, peer)
                    stage(x)
        return meshes, ref, stage

    @with_comms
    def test_stats_and_bias_per_stage(self):
        meshes, ref, stage = self._run_pipeline(dense_first=False)
        expected = load_stats(ref, process_group="local")
        self.assertEqual([s.name for s in expected], ["layers.0", "layers.1", "layers.2"])
        with CommDebugMode() as comm:
            stats = load_stats(stage, meshes=meshes)
        self.assertEqual(stats, expected)
        self.assertEqual(comm.get_total_counts(), 2, comm.get_comm_counts())  # all_gather_object
        self.assertEqual(stats[1].total, MICRO_BATCHES * 2 * B * L * 2)

        # a group that spans the stages raises on every rank, before any collective
        other = [r for r in range(self.world_size) if r not in meshes.stage_ranks]
        peer = [r for r in meshes.pp_mesh.mesh.tolist() if r != self.rank]
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(
                ValueError,
                rf"process_group holds ranks {re.escape(str(other))} outside this pipeline "
                rf"stage \(stage {meshes.pp_rank}, ranks "
                rf"{re.escape(str(list(meshes.stage_ranks)))}\).*Pass meshes=meshes alone",
            ):
                update_expert_bias(stage, RATE, meshes=meshes, process_group=dist.group.WORLD)
            with self.assertRaisesRegex(ValueError, rf"holds ranks {re.escape(str(peer))} "):
                update_expert_bias(stage, RATE, meshes=meshes,
                                   process_group=meshes.pp_mesh.get_group())
        self.assertEqual(comm.get_total_counts(), 0)
        dist.barrier()

        with CommDebugMode() as comm:
            update_expert_bias(stage, RATE, meshes=meshes)
        self.assertEqual(comm.get_total_counts(), 2)  # over the stage, + the first call's agreement
        update_expert_bias(ref, RATE)
        for name in STAGE_LAYERS[meshes.pp_rank]:
            bias, want = stage.layers[name].router.expert_bias, ref.layers[name].router.expert_bias
            self.assertTrue(want.abs().sum() > 0, name)
            self.assertEqual(bias, want, atol=0, rtol=0, msg=name)
            self.assertEqual(stage.layers[name].router.tokens_per_expert.sum().item(), 0)
        self.assertEqual([s.total for s in load_stats(stage, meshes=meshes)], [0, 0, 0])

    @with_comms
    def test_stage_without_moe_layer(self):
        meshes, ref, stage = self._run_pipeline(dense_first=True)
        stats = load_stats(stage, meshes=meshes, reset=True)
        self.assertEqual(stats, load_stats(ref, process_group="local"))
        self.assertEqual([s.name for s in stats], ["layers.1", "layers.2"])
        self.assertEqual([s.total for s in load_stats(stage, meshes=meshes)], [0, 0])  # reset

        with CommDebugMode() as comm:
            update_expert_bias(stage, RATE, meshes=meshes)
        self.assertEqual(comm.get_total_counts(), 1 if meshes.pp_rank == 0 else 2)  # + agreement
        if meshes.pp_rank == 0:  # dense only: no router, nothing to do, no collective
            with self.assertRaisesRegex(ValueError, r"found no router .* pass meshes="):
                update_expert_bias(stage, RATE, process_group=meshes.stage_group)
        dist.barrier()

    @with_comms
    def test_errors(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        stage = stage_module(full_model(dense_first=False), meshes.pp_rank)
        with self.assertRaisesRegex(TypeError, r"meshes must be the MoEMeshes .* got dict"):
            update_expert_bias(stage, RATE, meshes={})
        with self.assertRaisesRegex(ValueError, r"pass either meshes or process_group, got "
                                    r"process_group='local' with meshes"):
            load_stats(stage, meshes=meshes, process_group="local")
        # names repeated across stages (each stage named its layers from 0)
        with self.assertRaisesRegex(ValueError, r"two pipeline stages hold a layer named "
                                    r"'layers.0' \(stage 1 and an earlier one\)"):
            local = Layers({"0": make_moe(use_expert_bias=True)})
            load_stats(local, meshes=meshes)
        stats = load_stats(Layers({"0": make_moe()}), meshes=meshes, prefix=f"s{meshes.pp_rank}.")
        self.assertEqual([s.name for s in stats], ["s0.layers.0", "s1.layers.0"])


if __name__ == "__main__":
    run_tests()
