"""DTensor activations between pipeline stages, on 4 gloo ranks: pp2 x tp2 with sequence
parallelism and EP borrowing the tp ranks, under ``Schedule1F1B`` and
``ScheduleZBVZeroBubble``, against one process.

The residual stream leaves a stage as the ``Shard(1)`` DTensor on the stage's tp mesh that its
last block returns, and the next stage receives it as one: torch's ``PipelineStage`` sends each
rank's local shard and rebuilds the DTensor on the receiving side, forward and for its gradient
in backward. This needs torch's static metadata, with DTensors in all four of ``input_args``,
``output_args``, ``input_grads`` and ``output_grads`` (``(None,)`` where no DTensor crosses: the
first stage's input grads and the last stage's output grads). With any of them missing, torch
infers the metadata instead by running each stage's forward and backward once on uninitialized
buffers before the first step. A received DTensor gets the mesh with the same dim names and
layout among the stage's own example DTensors: the stage's tp mesh, when the examples are
DTensors on it (``meta`` local tensors are enough).

Each stage also checks, at runtime, every tensor it receives and sends against that metadata
(torch does under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), and records what its forward received.
Each tp rank computes the loss of its own tokens: divided by tp, the summed losses and every
param gradient must equal the single-process ones (1e-5 relative, fp32), and the routers'
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
from tests.test_pipeline_sequence_parallel import sequence_parallel

TP = 2


class DTensorStage(nn.Module):
    """A stage of :class:`PipeLM` whose boundaries are ``Shard(1)`` DTensors on the tp mesh
    (the first stage's input: this rank's tokens; the last stage's output: its logits)."""

    def __init__(self, inner: PipeLM, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.inner, self.tp_mesh = inner, tp_mesh
        self.received: list[tuple] = []  # (type, mesh, placements) of each forward's input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        if m.embed is not None:
            x = DTensor.from_local(m.embed(x), self.tp_mesh, [Shard(1)])
        else:
            self.received.append((type(x), x.device_mesh, x.placements))
        for layer in m.layers.values():
            x = layer(x)
        if m.norm is not None:
            return m.head(m.norm(x).to_local())
        return x


def hidden(tp_mesh: DeviceMesh, *, requires_grad: bool) -> DTensor:
    """The residual stream of one micro-batch as it crosses the stages: the example DTensor
    for ``PipelineStage`` (a ``meta`` local shard; global shape and stride given, so no
    collective runs)."""
    local = torch.empty(b, L // TP, DIM, device="meta")
    x = DTensor.from_local(local, tp_mesh, [Shard(1)], run_check=False,
                           shape=torch.Size((b, L, DIM)), stride=(L * DIM, DIM, 1))
    return x.requires_grad_(requires_grad)


class PipelineDTensorActivationsTest(DistTestBase):
    def _check(self, schedule_cls, style: str) -> None:
        meshes = build_moe_meshes(pp=2, dp=1, ep=2, tp=TP, device_type="cpu")
        tp_mesh = meshes.dense["tp"]
        indices = stages_of(meshes.pp_rank, meshes.pp, style)
        num_stages = meshes.pp * len(indices)
        full, ref = PipeLM(), PipeLM(aux_loss_mode="collect")
        modules, wrappers, stages = [], [], []
        for index in indices:
            module = stage_module(full, index, num_stages)
            sequence_parallel(module, tp_mesh)
            parallelize_moe(module, meshes, sequence_parallel=True)
            first, last = index == 0, index == num_stages - 1
            wrapper = DTensorStage(module, tp_mesh)
            debug_level = dist.get_debug_level()
            dist.set_debug_level(dist.DebugLevel.DETAIL)  # it validates what it sends/receives
            try:
                stages.append(PipelineStage(
                    wrapper, index, num_stages, torch.device("cpu"),
                    input_args=torch.empty(b, L // TP, dtype=torch.long, device="meta")
                    if first else hidden(tp_mesh, requires_grad=True),
                    output_args=torch.empty(b, L // TP, VOCAB, device="meta",
                                            requires_grad=True)
                    if last else hidden(tp_mesh, requires_grad=True),
                    input_grads=(None,) if first else hidden(tp_mesh, requires_grad=False),
                    output_grads=(None,) if last else hidden(tp_mesh, requires_grad=False),
                    group=meshes.pp_mesh.get_group(),
                ))
            finally:
                dist.set_debug_level(debug_level)
            modules.append(module)
            wrappers.append(wrapper)
        schedule = (schedule_cls(stages[0], N_MICRO, loss_fn=loss_fn) if style == "single"
                    else schedule_cls(stages, N_MICRO, loss_fn=loss_fn))

        T = tokens(1)
        t = tp_mesh.get_local_rank()
        columns = slice(t * (L // TP), (t + 1) * (L // TP))  # this tp rank's sequence shard
        inputs = T[:, :-1][:, columns].contiguous()
        targets = T[:, 1:][:, columns].contiguous()
        losses: list[torch.Tensor] = []
        last = dict(target=targets, losses=losses) if num_stages - 1 in indices else {}
        schedule.step(*([inputs] if 0 in indices else []), **last)
        ref_losses = reference_step(ref, T, 1)

        what = schedule_cls.__name__
        for index, wrapper in zip(indices, wrappers):  # every later stage received DTensors
            expected = [] if index == 0 else [(DTensor, tp_mesh, (Shard(1),))] * N_MICRO
            self.assertEqual(wrapper.received, expected, f"{what} stage {index}")
        if losses:
            got = torch.stack(losses).detach()
            dist.all_reduce(got, group=tp_mesh.get_group())
            close(got / TP, torch.stack(ref_losses), f"{what} losses")
        ref_params = dict(ref.named_parameters())
        for module in modules:
            for name, param in module.named_parameters():
                grad = param.grad
                self.assertIsNotNone(grad, f"{what} {name}")
                if isinstance(grad, DTensor):
                    grad = grad.redistribute(placements=param.placements).full_tensor()
                else:  # the embedding and the head: each tp rank saw its own tokens
                    grad = grad.clone()
                    dist.all_reduce(grad, group=tp_mesh.get_group())
                close(grad / TP, ref_params[name].grad, f"{what} {name}")
        stats = sorted(load_stats(modules, meshes=meshes), key=lambda layer: layer.name)
        self.assertEqual(stats, load_stats(ref, process_group="local"), what)

    @with_comms
    def test_1f1b(self):
        self._check(Schedule1F1B, "single")

    @with_comms
    def test_zero_bubble_v(self):
        self._check(ScheduleZBVZeroBubble, "v")


if __name__ == "__main__":
    run_tests()
