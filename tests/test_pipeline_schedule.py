"""A tiny MoE language model under ``torch.distributed.pipelining`` schedules, on 4 gloo ranks:
pp2 x dp2 with EP2 inside each stage (no router losses, no FSDP), against one process that
accumulates the same global micro-batches.

The model is split the torchtitan way: each stage is a full copy with the other stage's modules
deleted, so its names are the model's. Two pipelines (dp ranks 0 and 1 of each stage) run the
schedule on their halves of every micro-batch; the experts of a stage exchange tokens across the
two pipelines (EP over the stage's dp ranks). Losses and every param gradient must match the
single-process run within 1e-5 relative (fp32), and so must the counters of every router.

Shape legend: b sequences per micro-batch and dp rank, L tokens per sequence, D dim, V vocab.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes
from dtensor_moe.moe import load_stats
from dtensor_moe.parallel import parallelize_moe
from tests._dist import DistTestBase
from tests._moe_model import DIM, VOCAB, Block, moe_config
from tests.test_parallel_moe import close

N_MICRO, b, L = 4, 2, 6
STAGE_LAYERS = (("0",), ("1",))


class PipeLM(nn.Module):
    """Embedding, blocks in a ModuleDict keyed by index, norm and head; a stage deletes what
    another stage holds (``None`` modules are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({name: Block(moe_config()) for (name,) in STAGE_LAYERS})
        self.norm: nn.Module | None = nn.RMSNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.head(self.norm(h))
        return h


def stage_module(full: PipeLM, pp_rank: int) -> PipeLM:
    stage = copy.deepcopy(full)
    for name in STAGE_LAYERS[1 - pp_rank]:
        del stage.layers[name]
    if pp_rank == 0:
        stage.norm = stage.head = None
    else:
        stage.embed = None
    return stage


def loss_fn(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.reshape(-1, VOCAB), targets_BL.reshape(-1))


def tokens(dp: int) -> torch.Tensor:
    """The global batch, dp rank d's part in rows ``d * N_MICRO * b`` onwards."""
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (dp * N_MICRO * b, L + 1), generator=gen)


class PipelineScheduleTest(DistTestBase):
    def _check(self, schedule_cls) -> None:
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        full = PipeLM()
        ref = copy.deepcopy(full)
        stage = parallelize_moe(stage_module(full, meshes.pp_rank), meshes,
                                sequence_parallel=False)
        first = meshes.pp_rank == 0
        meta = dict(device="meta")
        hidden = torch.empty(b, L, DIM, **meta, requires_grad=True)  # crosses stages with grad
        pipe_stage = PipelineStage(
            stage, meshes.pp_rank, meshes.pp, torch.device("cpu"),
            input_args=torch.empty(b, L, dtype=torch.long, **meta) if first else hidden,
            output_args=hidden if first else torch.empty(b, L, VOCAB, **meta, requires_grad=True),
            group=meshes.pp_mesh.get_group(),
        )
        schedule = schedule_cls(pipe_stage, N_MICRO, loss_fn=loss_fn)

        T = tokens(meshes.dp)
        d = meshes.dense.get_local_rank("dp")
        local = T[d * N_MICRO * b : (d + 1) * N_MICRO * b]
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(local[:, :-1])
        else:
            schedule.step(target=local[:, 1:], losses=losses)

        # the reference: the global micro-batch m is every dp rank's m-th chunk
        ref_losses = []
        for m in range(N_MICRO):
            rows = torch.cat([torch.arange(n * N_MICRO * b + m * b, n * N_MICRO * b + (m + 1) * b)
                              for n in range(meshes.dp)])
            loss = loss_fn(ref(T[rows, :-1]), T[rows, 1:])
            (loss / N_MICRO).backward()
            ref_losses.append(loss.detach())

        dp_group = meshes.dense.get_group("dp")
        if not first:
            got = torch.stack(losses).detach()
            dist.all_reduce(got, group=dp_group)
            close(got / meshes.dp, torch.stack(ref_losses), f"{schedule_cls.__name__} losses")
        ref_params = dict(ref.named_parameters())
        names = [name for name, _ in stage.named_parameters()]
        self.assertTrue(any(".moe.experts." in n for n in names), names)
        for name, param in stage.named_parameters():
            grad = param.grad
            if isinstance(grad, DTensor):
                # routed experts, Shard(0) on ep: every token of the stage reached them already
                grad = grad.full_tensor()
            else:
                grad = grad.clone()
                dist.all_reduce(grad, group=dp_group)
            close(grad / meshes.dp, ref_params[name].grad, f"{schedule_cls.__name__} {name}")
        stats = load_stats(stage, meshes=meshes)
        self.assertEqual(stats, load_stats(ref, process_group="local"), schedule_cls.__name__)
        self.assertEqual([s.name for s in stats], ["layers.0.moe", "layers.1.moe"])

    @with_comms
    def test_gpipe(self):
        self._check(ScheduleGPipe)

    @with_comms
    def test_1f1b(self):
        self._check(Schedule1F1B)


if __name__ == "__main__":
    run_tests()
