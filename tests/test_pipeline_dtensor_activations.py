"""DTensor activations between pipeline stages, on 4 gloo ranks: pp2 x tp2 with sequence parallelism
and EP borrowing the tp ranks, under ``Schedule1F1B`` and ``ScheduleZBVZeroBubble``, against one
process.

The residual stream leaves a stage as the ``Shard(1)`` DTensor on the stage's tp mesh that its last
block returns, and the next stage receives it as one: torch's ``PipelineStage`` sends each rank's
local shard and rebuilds the DTensor on the receiving side, forward and for its gradient in
backward. This needs torch's static metadata, with DTensors in all four of ``input_args``,
``output_args``, ``input_grads`` and ``output_grads`` (``(None,)`` where no DTensor crosses: the
first stage's input grads and the last stage's output grads). With any of them missing, torch
infers the metadata instead, before the first step, by running each stage's forward and backward
once more: the first stage on the first micro-batch, the others on uninitialized buffers. A
received DTensor gets the mesh with the same dim names and layout among the stage's own example
DTensors: the stage's tp mesh, when the examples are DTensors on it (``meta`` local tensors are
enough).

Each stage is built under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s debug level, so that torch checks
every tensor it receives and sends (the input gradients autograd computes included) against that
metadata, and the stage module records what its forward received. ``Schedule1F1B`` runs uneven
sequence shards (7 tokens: 4 and 3), ``ScheduleZBVZeroBubble`` even ones (6 tokens);
``DTENSOR_MOE_FULL_MATRIX=1`` adds ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
``ScheduleDualPipeV`` and ``ScheduleInterleavedZeroBubble`` with uneven shards. Each tp rank's
loss is the sum over its own tokens divided by every token's count, so that the tp ranks' losses
and grads add up to the single-process ones: those must agree within 1e-5 relative (fp32), and so
must the routers' counters.

Shape legend: b sequences per micro-batch, S tokens per sequence, D dim, V vocab.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes, parallelize_moe
from tests._dist import DistTestBase
from tests._moe_model import DIM, VOCAB
from tests.test_parallel_moe import close
from tests.test_pipeline_schedule import (
    N_MICRO,
    PipeLM,
    b,
    reference_step,
    stage_module,
    stages_of,
)
from tests.test_pipeline_sequence_parallel import (
    check_stage_grads,
    sequence_parallel,
    step_on_shards,
)

TP = 2
# DTENSOR_MOE_FULL_MATRIX=1: the other schedules too, with uneven shards (one stage per rank,
# or two looped or V-shaped)
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


class DTensorStage(nn.Module):
    """A stage of :class:`PipeLM` whose boundaries are ``Shard(1)`` DTensors on the tp mesh
    (the first stage's input: this rank's tokens; the last stage's output: its logits)."""

    def __init__(self, inner: PipeLM, tp_mesh: DeviceMesh, seq_len: int) -> None:
        super().__init__()
        self.inner, self.tp_mesh, self.seq_len = inner, tp_mesh, seq_len
        self.received: list[tuple] = []  # (type, mesh, placements) of each forward's input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        if m.embed is not None:  # the global shape: the shards may be uneven
            h = m.embed(x)
            x = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False,
                                   shape=torch.Size((h.shape[0], self.seq_len, DIM)),
                                   stride=(self.seq_len * DIM, DIM, 1))
        else:
            self.received.append((type(x), x.device_mesh, x.placements))
        for layer in m.layers.values():
            x = layer(x)
        if m.norm is not None:
            return m.head(m.norm(x).to_local())
        return x


def hidden(tp_mesh: DeviceMesh, seq_len: int, *, requires_grad: bool) -> DTensor:
    """The residual stream of one micro-batch as it crosses the stages: the example DTensor
    for ``PipelineStage``, a ``meta`` local shard of this rank's size (global shape and stride
    given, so that no collective runs and uneven shards are right)."""
    local = torch.empty(b, shard_size(tp_mesh, seq_len), DIM, device="meta")
    x = DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False,
                           shape=torch.Size((b, seq_len, DIM)), stride=(seq_len * DIM, DIM, 1))
    return x.requires_grad_(requires_grad)


def shard_columns(tp_mesh: DeviceMesh, seq_len: int) -> torch.Tensor:
    """This tp rank's positions of the sequence, as ``Shard(1)`` splits it."""
    return torch.arange(seq_len).chunk(TP)[tp_mesh.get_local_rank()]


def shard_size(tp_mesh: DeviceMesh, seq_len: int) -> int:
    return len(shard_columns(tp_mesh, seq_len))


def tokens(seq_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (N_MICRO * b, seq_len + 1), generator=gen)


def shard_loss(seq_len: int):
    """Each tp rank's share of the micro-batch's mean loss: the sum over its own tokens divided
    by every token's count, so that the tp ranks' losses (and grads) add up to one process's,
    with uneven shards too."""
    def loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits_BSV.reshape(-1, VOCAB), targets_BS.reshape(-1),
                                reduction="sum")
        return total / (logits_BSV.shape[0] * seq_len)
    return loss


class PipelineDTensorActivationsTest(DistTestBase):
    def _check(self, schedule_cls, style: str, seq_len: int) -> None:
        meshes = build_moe_meshes(pp=2, dp=1, ep=2, tp=TP, device_type="cpu")
        tp_mesh = meshes.dense["tp"]
        indices = stages_of(meshes.pp_rank, meshes.pp, style)
        num_stages = meshes.pp * len(indices)
        full, ref = PipeLM(), PipeLM(aux_loss_mode="collect")
        shard = shard_size(tp_mesh, seq_len)
        modules, wrappers, stages = [], [], []
        for index in indices:
            module = stage_module(full, index, num_stages)
            sequence_parallel(module, tp_mesh)
            parallelize_moe(module, meshes, sequence_parallel=True)
            first, last = index == 0, index == num_stages - 1
            wrapper = DTensorStage(module, tp_mesh, seq_len)
            act, grad = (hidden(tp_mesh, seq_len, requires_grad=r) for r in (True, False))
            token_ids = torch.empty(b, shard, dtype=torch.long, device="meta")
            logits = torch.empty(b, shard, VOCAB, device="meta", requires_grad=True)
            debug_level = dist.get_debug_level()
            dist.set_debug_level(dist.DebugLevel.DETAIL)  # it validates what it sends/receives
            try:
                stages.append(PipelineStage(
                    wrapper, index, num_stages, torch.device("cpu"),
                    input_args=token_ids if first else act,
                    output_args=logits if last else act,
                    input_grads=(None,) if first else grad,
                    output_grads=(None,) if last else grad,
                    group=meshes.pp_mesh.get_group(),
                ))
            finally:
                dist.set_debug_level(debug_level)
            modules.append(module)
            wrappers.append(wrapper)
        T = tokens(seq_len)
        columns = shard_columns(tp_mesh, seq_len)  # this tp rank's sequence shard
        losses = step_on_shards(schedule_cls, style, stages, shard_loss(seq_len), T, columns,
                                indices, num_stages)
        ref_losses = reference_step(ref, T, 1)

        what = schedule_cls.__name__
        for index, wrapper in zip(indices, wrappers):  # every later stage received DTensors
            expected = [] if index == 0 else [(DTensor, tp_mesh, (Shard(1),))] * N_MICRO
            self.assertEqual(wrapper.received, expected, f"{what} stage {index}")
        if losses:
            got = torch.stack(losses).detach()
            dist.all_reduce(got, group=tp_mesh.get_group())
            close(got, torch.stack(ref_losses), f"{what} losses")
        check_stage_grads(self, modules, ref, meshes, what)

    @with_comms
    def test_1f1b(self):
        self._check(Schedule1F1B, "single", seq_len=7)  # shards of 4 and 3 tokens
        for schedule_cls, style in [(ScheduleGPipe, "single"),
                                    (ScheduleInterleaved1F1B, "loop")] if FULL else []:
            self._check(schedule_cls, style, seq_len=7)

    @with_comms
    def test_zero_bubble_v(self):
        self._check(ScheduleZBVZeroBubble, "v", seq_len=6)
        for schedule_cls, style in [(ScheduleDualPipeV, "v"),
                                    (ScheduleInterleavedZeroBubble, "loop")] if FULL else []:
            self._check(schedule_cls, style, seq_len=7)


if __name__ == "__main__":
    run_tests()
