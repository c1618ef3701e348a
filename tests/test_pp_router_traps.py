"""Router traps under pipeline parallelism, on 4 gloo ranks: pp2 x dp2 with EP2 in each stage.

* A process group that spans the stages (the world, a pp group), passed to
  ``update_expert_bias``, ``load_stats`` or ``set_aux_loss_group`` without ``meshes=``: every
  rank raises before any collective, from the stage ``parallelize_moe`` recorded on the routers
  (before, the counters of other stages' layers were summed in, or gloo failed on the sizes).
* ``update_expert_bias(stage, rate, meshes=meshes)`` when no stage holds a biased router: every
  rank raises (before, it returned silently); a dense stage beside a biased one is fine.
* A ``PipelineStage`` built without ``input_args``/``output_args``: torch runs every stage's
  forward and backward once more before the first step; the routers' counters and the expert
  bias after one update still match one process (before, the counters held those tokens too).

The stage modules are those of ``tests/test_pipeline_balance.py``: the full model's names, a
``ModuleDict`` keyed by layer index, the other stage's layers deleted.

Shape legend: B sequences per micro-batch, L tokens per sequence, D dim.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms
from torch.utils.checkpoint import checkpoint

from dtensor_moe import build_moe_meshes
from dtensor_moe.moe import load_stats, set_aux_loss_group, update_expert_bias
from dtensor_moe.parallel import parallelize_moe
from tests._dist import DistTestBase
from tests.test_moe_layer import D, make_moe
from tests.test_pipeline_balance import Layers, full_model, stage_module

B, L, MICRO_BATCHES, RATE = 2, 5, 2, 0.125


class CheckpointedLayers(Layers):
    """:class:`Layers` with every layer under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + checkpoint(layer, x, use_reentrant=False)
        return x


class PipelineRouterTrapsTest(DistTestBase):
    def _spanning_group_raises(self, meshes, stage) -> None:
        """Every helper refuses the world and the pp group, with no collective."""
        other = [r for r in range(self.world_size) if r not in meshes.stage_ranks]
        peer = [r for r in meshes.pp_mesh.mesh.tolist() if r != self.rank]
        where = (rf"outside the pipeline stage of the module's routers \(stage {meshes.pp_rank}, "
                 rf"ranks {re.escape(str(list(meshes.stage_ranks)))}, as parallelize_moe "
                 r"recorded\).*")
        world = dist.group.WORLD
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(ValueError, rf"update_expert_bias: the process group "
                                        rf"holds ranks {re.escape(str(other))} {where}Pass "
                                        r"meshes=meshes"):
                update_expert_bias(stage, RATE, process_group=world)
            with self.assertRaisesRegex(ValueError, rf"holds ranks {re.escape(str(peer))} "):
                update_expert_bias(stage, RATE, process_group=meshes.pp_mesh.get_group())
            for group in ("world", world):  # "world", the default, too
                with self.assertRaisesRegex(ValueError, rf"load_stats: the process group holds "
                                            rf"ranks {re.escape(str(other))} {where}Pass "
                                            r"meshes=meshes"):
                    load_stats(stage, process_group=group)
        self.assertEqual(comm.get_total_counts(), 0, comm.get_comm_counts())
        name = str(10 + meshes.pp_rank)  # each stage its own layer name
        global_batch = Layers({name: make_moe(aux_loss_type="global_batch", aux_loss_coeff=1e-2)})
        router = global_batch.layers[name].router
        router.aux_loss_group = world  # set before parallelize_moe
        with self.assertRaisesRegex(ValueError, rf"parallelize_moe \(aux_loss_group\): the "
                                    rf"process group holds ranks {re.escape(str(other))} "):
            parallelize_moe(global_batch, meshes, sequence_parallel=False)
        router.aux_loss_group = None
        parallelize_moe(global_batch, meshes, sequence_parallel=False)
        with self.assertRaisesRegex(ValueError, rf"set_aux_loss_group: the process group holds "
                                    rf"ranks {re.escape(str(other))} {where}Pass "
                                    r"group=meshes.stage_group"):
            set_aux_loss_group(global_batch, world)
        set_aux_loss_group(global_batch, meshes.stage_group)  # inside the stage: fine
        update_expert_bias(stage, RATE, process_group=meshes.stage_group)
        self.assertEqual(load_stats(stage, process_group="local")[0].total, 0)

    @with_comms
    def test_groups_that_span_stages_and_models_without_bias(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        stage = stage_module(full_model(dense_first=False), meshes.pp_rank)
        parallelize_moe(stage, meshes, sequence_parallel=False)
        self.assertEqual(stage.layers[str(2 * meshes.pp_rank)].router.stage_ranks,
                         meshes.stage_ranks)
        x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(self.rank))
        stage.train()(x)  # counters on every rank, of other sizes in the other stage
        self._spanning_group_raises(meshes, stage)
        dist.barrier()

        # no stage holds a biased router: every rank raises after the agreement
        unbiased = stage_module(Layers({str(i): make_moe(i) for i in range(3)}), meshes.pp_rank)
        with self.assertRaisesRegex(ValueError, r"found no router with an expert bias in any of "
                                    r"the 2 pipeline stages \(this rank's module: Layers\).*"
                                    r"several stages passes them in one call"):
            update_expert_bias(unbiased, RATE, meshes=meshes)

        # a dense stage beside a biased one: one agreement on the first call only
        mixed = stage_module(full_model(dense_first=True), meshes.pp_rank)
        counts = []
        for _ in range(2):
            with CommDebugMode() as comm:
                update_expert_bias(mixed, RATE, meshes=meshes)
            counts.append(comm.get_total_counts())
        self.assertEqual(counts, [1, 0] if meshes.pp_rank == 0 else [2, 1])
        dist.barrier()

    @with_comms
    def test_stage_without_static_metadata_counts_the_training_tokens_only(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        full = full_model(dense_first=False)
        ref = copy.deepcopy(full).train()
        part = stage_module(full, meshes.pp_rank)
        # stage 1 checkpoints its layers: the recompute in torch's inference backward and in
        # the step's backward counts nothing
        stage_cls = Layers if meshes.pp_rank == 0 else CheckpointedLayers
        module = stage_cls(dict(part.layers.items())).train()
        parallelize_moe(module, meshes, sequence_parallel=False)
        stage = PipelineStage(module, meshes.pp_rank, meshes.pp, torch.device("cpu"),
                              group=meshes.pp_mesh.get_group())  # no input_args/output_args
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES,
                                 loss_fn=lambda y, t: ((y - t) ** 2).mean())
        X = torch.randn(2 * MICRO_BATCHES * B, L, D, generator=torch.Generator().manual_seed(3))
        d = meshes.dense.get_local_rank("dp")
        rows = slice(d * MICRO_BATCHES * B, (d + 1) * MICRO_BATCHES * B)  # this pipeline's
        if meshes.pp_rank == 0:
            schedule.step(X[rows])
        else:
            schedule.step(target=torch.zeros_like(X[rows]))
        ref(X)  # one process, the global batch

        stats, expected = load_stats(module, meshes=meshes), load_stats(ref, process_group="local")
        self.assertEqual([s.name for s in stats], ["layers.0", "layers.1", "layers.2"])
        self.assertEqual([s.total for s in stats], [X.shape[0] * L * 2] * 3)  # top-2, no more
        self.assertEqual(stats, expected)
        update_expert_bias(module, RATE, meshes=meshes)
        update_expert_bias(ref, RATE)
        for name in module.layers:
            bias, want = module.layers[name].router.expert_bias, ref.layers[name].router.expert_bias
            self.assertTrue(want.abs().sum() > 0, name)
            self.assertEqual(bias, want, atol=0, rtol=0, msg=name)
        dist.barrier()


if __name__ == "__main__":
    run_tests()
