"""Sequence parallelism inside each pipeline stage, on 4 gloo ranks: pp2 x tp2 with EP borrowing
the tp ranks, under ``Schedule1F1B`` and ``ScheduleZBVZeroBubble``, against one process.

Each stage runs Megatron-style TP + SP on its blocks' norms and MLP and the MoE layer's SP plan;
the residual stream is a ``Shard(1)`` DTensor on the tp mesh inside a stage, and crosses stages
as each tp rank's local sequence shard (a plain tensor, which is what torch's pipelining sends):
:class:`SequenceShardStage` turns it back into a DTensor at the stage's input and hands the
local shard on at its output. Each tp rank computes the loss of its own tokens, so every
gradient is the sum over the tp ranks of their shard's mean: divided by tp, it must equal the
single-process gradient of the mean over all tokens (1e-5 relative, fp32), and the routers'
counters must agree.

Shape legend: b sequences per micro-batch, L tokens per sequence, D dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes, parallelize_moe
from dtensor_moe.moe import load_stats
from tests._dist import DistTestBase
from tests._moe_model import DIM, VOCAB
from tests.test_parallel_moe import close
from tests.test_pipeline_schedule import (
    N_MICRO,
    L,
    PipeLM,
    b,
    loss_fn,
    reference_step,
    stage_module,
    stages_of,
    tokens,
)

TP = 2


class SequenceShardStage(nn.Module):
    """A stage of :class:`PipeLM` whose boundaries are local sequence shards."""

    def __init__(self, inner: PipeLM, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.inner, self.tp_mesh = inner, tp_mesh

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        m = self.inner
        if m.embed is not None:
            h = m.embed(h)  # this rank's tokens
        x = DTensor.from_local(h, self.tp_mesh, [Shard(1)])
        for layer in m.layers.values():
            x = layer(x)
        if m.norm is not None:
            return m.head(m.norm(x).to_local())
        # not a view: the zero-bubble schedules detach_() a stage's outputs in place
        return x.to_local().clone()


def sequence_parallel(module: PipeLM, tp_mesh: DeviceMesh) -> None:
    for block in module.layers.values():
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "norm2": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    if module.norm is not None:
        parallelize_module(module, tp_mesh, {"norm": SequenceParallel(use_local_output=False)})


def step_on_shards(
    schedule_cls, style: str, stages: list, loss_fn, T: torch.Tensor, columns, indices: list[int],
    num_stages: int,
) -> list[torch.Tensor]:
    """One step of a ``schedule_cls`` schedule over ``stages`` on this tp rank's sequence
    shard (``columns``) of the tokens ``T``; the last stage's losses (empty elsewhere)."""
    schedule = (schedule_cls(stages[0], N_MICRO, loss_fn=loss_fn) if style == "single"
                else schedule_cls(stages, N_MICRO, loss_fn=loss_fn))
    inputs, targets = T[:, :-1][:, columns], T[:, 1:][:, columns]
    losses: list[torch.Tensor] = []
    last = dict(target=targets, losses=losses) if num_stages - 1 in indices else {}
    schedule.step(*([inputs] if 0 in indices else []), **last)
    return losses


def check_stage_grads(test, modules, ref, meshes, what: str, divide_by: int = 1) -> None:
    """Every param grad of the stage modules (a DTensor's whole, a plain grad summed over the
    tp ranks, each of which saw its own tokens), divided by ``divide_by``, against the
    reference's; and every router's counters."""
    tp_mesh = meshes.dense["tp"]
    ref_params = dict(ref.named_parameters())
    for module in modules:
        for name, param in module.named_parameters():
            grad = param.grad
            test.assertIsNotNone(grad, f"{what} {name}")
            if isinstance(grad, DTensor):
                grad = grad.redistribute(placements=param.placements).full_tensor()
            else:  # the embedding and the head
                grad = grad.clone()
                dist.all_reduce(grad, group=tp_mesh.get_group())
            close(grad / divide_by, ref_params[name].grad, f"{what} {name}")
    stats = sorted(load_stats(modules, meshes=meshes), key=lambda layer: layer.name)
    test.assertEqual(stats, load_stats(ref, process_group="local"), what)


class PipelineSequenceParallelTest(DistTestBase):
    def _check(self, schedule_cls, style: str) -> None:
        meshes = build_moe_meshes(pp=2, dp=1, ep=2, tp=TP, device_type="cpu")
        tp_mesh = meshes.dense["tp"]
        indices = stages_of(meshes.pp_rank, meshes.pp, style)
        num_stages = meshes.pp * len(indices)
        full, ref = PipeLM(), PipeLM(aux_loss_mode="collect")
        meta = dict(device="meta")
        hidden = torch.empty(b, L // TP, DIM, **meta, requires_grad=True)
        modules, stages = [], []
        for index in indices:
            module = stage_module(full, index, num_stages)
            sequence_parallel(module, tp_mesh)
            parallelize_moe(module, meshes, sequence_parallel=True)
            last = index == num_stages - 1
            stages.append(PipelineStage(
                SequenceShardStage(module, tp_mesh), index, num_stages, torch.device("cpu"),
                input_args=torch.empty(b, L // TP, dtype=torch.long, **meta) if index == 0
                else hidden,
                output_args=torch.empty(b, L // TP, VOCAB, **meta, requires_grad=True) if last
                else hidden,
                group=meshes.pp_mesh.get_group(),
            ))
            modules.append(module)
        T = tokens(1)
        t = tp_mesh.get_local_rank()
        columns = slice(t * (L // TP), (t + 1) * (L // TP))  # this tp rank's sequence shard
        losses = step_on_shards(schedule_cls, style, stages, loss_fn, T, columns, indices,
                                num_stages)
        ref_losses = reference_step(ref, T, 1)

        what = schedule_cls.__name__
        if losses:
            got = torch.stack(losses).detach()
            dist.all_reduce(got, group=tp_mesh.get_group())
            close(got / TP, torch.stack(ref_losses), f"{what} losses")
        check_stage_grads(self, modules, ref, meshes, what, divide_by=TP)

    @with_comms
    def test_1f1b(self):
        self._check(Schedule1F1B, "single")

    @with_comms
    def test_zero_bubble_v(self):
        self._check(ScheduleZBVZeroBubble, "v")


if __name__ == "__main__":
    run_tests()
