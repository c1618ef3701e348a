"""Pipeline-stage setup traps (gloo, 4 ranks, ``build_moe_meshes(pp=2, dp=2)``): every rank raises
before any step, or the default is the safe one.

* Stage modules split from an ``nn.ModuleList`` (``del`` renumbers it) hold the same names on
  both stages; a checkpoint would then store both stages' tensors under the same keys.
  ``check_stage_names`` (and ``build_stage``, which runs it) refuses them on every rank; an
  ``nn.ModuleDict`` keyed by the layer index passes, before and after ``parallelize_dense`` and
  ``fully_shard_moe``.
* ``fully_shard_moe`` keeps the params gathered after forward by default when ``pp > 1``, and
  ``check_schedule`` / ``overlap_f_b`` refuse ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``
  over stages that reshard after forward (torch 2.13 leaves grads ``None`` or wrong there).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal import common_distributed
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, MoEConfig, _compat, build_moe_meshes
from dtensor_moe.parallel import (
    DenseNames,
    build_stage,
    check_schedule,
    check_stage_names,
    fully_shard_moe,
    overlap_f_b,
    parallelize_dense,
)
from tests._dist import DistTestBase

_TESTS = ("test_stage_names_clash_on_every_rank", "test_fsdp_under_v_schedules")
common_distributed.TIMEOUT_OVERRIDE.update(dict.fromkeys(_TESTS, 40))  # a hang fails in 40 s

CONFIG = MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2, use_expert_bias=True)
NAMES = DenseNames(embedding=None, gathered=(), colwise=("up",), rowwise=("down",), norms=(),
                   final_norm=None, output=None)  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.moe = nn.Linear(8, 16), nn.Linear(16, 8), MoE(CONFIG)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.up(h)) + self.moe(h)


class Net(nn.Module):
    def __init__(self, container: type[nn.ModuleList] | type[nn.ModuleDict]) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [Block() for _ in range(4)]
        if container is nn.ModuleDict:
            self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        else:
            self.layers = nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for block in blocks:
            h = block(h)
        return h


def stage_of(model: Net, keep: tuple[int, ...]) -> Net:
    """``model`` without the layers other stages hold: ``del``, as a user splits a model."""
    stage = copy.deepcopy(model)
    for i in sorted(set(range(4)) - set(keep), reverse=True):
        del stage.layers[i if isinstance(stage.layers, nn.ModuleList) else str(i)]
    return stage


class StageTrapsTest(DistTestBase):
    @with_comms
    def test_stage_names_clash_on_every_rank(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=1)
        keep = (0, 1) if meshes.pp_rank == 0 else (2, 3)
        pp_ranks = [self.rank % 2, self.rank % 2 + 2]
        renumbered = stage_of(Net(nn.ModuleList), keep)
        n = len(renumbered.state_dict())  # params and persistent buffers: all clash
        clash = (
            rf"check_stage_names: {n} param/buffer names are held by more than one pipeline "
            rf"stage module: layers\.0\.down\.bias \(ranks \[{pp_ranks[0]}, {pp_ranks[1]}\]\), "
            rf".* and {n - 8} more\. A checkpoint would store these stages' tensors under the "
            r"same keys .* hold the layers in an nn\.ModuleDict keyed by their index in the full "
            r"model"
        )
        for modules in (renumbered, [renumbered]):
            with CommDebugMode() as mode, self.assertRaisesRegex(ValueError, clash):
                check_stage_names(modules, meshes)
            counts = {str(k): v for k, v in mode.get_comm_counts().items()}
            self.assertEqual(counts, {"c10d.allgather_": 2}, "only all_gather_object's")
        # build_stage runs the check (every recipe builds its stages on every rank)
        x = torch.empty(2, 8)
        with self.assertRaisesRegex(ValueError, clash.replace("check_stage_names", "build_stage")):
            build_stage(renumbered, meshes, stage_index=meshes.pp_rank, num_stages=2,
                        input_args=x, output_args=x)  # fmt: skip
        # a rank's own two stages are compared with each other only when passed together
        both = [stage_of(Net(nn.ModuleList), (0,)), stage_of(Net(nn.ModuleList), (1,))]
        with self.assertRaisesRegex(ValueError, r"held by more than one pipeline stage module"):
            check_stage_names(both, meshes)
        # the full model's names: no error, and fully_shard_moe takes the ModuleDict of blocks
        # and keeps the params gathered after forward by default under pipeline parallelism
        kept = stage_of(Net(nn.ModuleDict), keep)
        self.assertEqual(sorted(kept.layers), [str(i) for i in keep])
        check_stage_names(kept, meshes)
        parallelize_dense(kept, meshes.dense["tp"], sequence_parallel=False, names=NAMES)
        fully_shard_moe(kept, meshes, blocks=kept.layers)
        for block in kept.layers.values():
            self.assertFalse(_compat.fsdp_reshards_after_forward(block, root=False))
        check_stage_names(kept, meshes)  # fully_shard and the styles keep the names
        with self.assertRaisesRegex(TypeError, "check_stage_names: meshes must be the MoEMeshes"):
            check_stage_names(kept, meshes.dense)

    def _v_schedule(self, schedule_cls, meshes, reshard: bool):
        """Two stages per rank (V: rank r holds stages r and 3 - r), each a Linear sharded
        with FSDP2 inside a parent; static metadata, so building them communicates nothing."""
        stages = []
        for index in (meshes.pp_rank, 2 * meshes.pp - 1 - meshes.pp_rank):
            module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            fully_shard(module[0], mesh=meshes.dense["dp"], reshard_after_forward=reshard)
            fully_shard(module, mesh=meshes.dense["dp"], reshard_after_forward=False)
            x = torch.empty(2, 4, device="meta", requires_grad=True)
            stages.append(PipelineStage(module, index, 2 * meshes.pp, torch.device("cpu"),
                                        input_args=x, output_args=x,
                                        group=meshes.pp_mesh.get_group()))  # fmt: skip
        return schedule_cls(stages, n_microbatches=4, loss_fn=lambda y, t: y.sum())

    @with_comms
    def test_fsdp_under_v_schedules(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=1)
        stage = meshes.pp_rank
        message = (
            rf"{{}}: stage {stage}'s FSDP2 modules \['0'\] reshard their params after forward "
            r"\(reshard_after_forward=True\), with which torch's V-shaped schedules leave some "
            r"gradients None or wrong; pass reshard_after_forward=False to fully_shard_moe"
        )
        for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
            schedule = self._v_schedule(cls, meshes, reshard=True)
            with CommDebugMode() as mode:
                with self.assertRaisesRegex(ValueError, message.format(cls.__name__)):
                    check_schedule(schedule)
                if cls is ScheduleDualPipeV:
                    with self.assertRaisesRegex(ValueError, message.format(cls.__name__)):
                        overlap_f_b(schedule)
            self.assertEqual(mode.get_total_counts(), 0)
            schedule = self._v_schedule(cls, meshes, reshard=False)
            self.assertIs(check_schedule(schedule), schedule)
        # fully_shard_moe: False by default with pp > 1, True on request (and refused above)
        keep = (0, 1) if stage == 0 else (2, 3)
        for reshard in (None, True):
            model = stage_of(Net(nn.ModuleDict), keep)
            fully_shard_moe(model, meshes, blocks=model.layers, reshard_after_forward=reshard)
            for block in model.layers.values():
                got = _compat.fsdp_reshards_after_forward(block, root=False)
                self.assertEqual(got, bool(reshard), f"reshard_after_forward={reshard}")


if __name__ == "__main__":
    run_tests()
