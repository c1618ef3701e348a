"""A tiny MoE language model under ``torch.distributed.pipelining`` schedules, on 4 gloo ranks:
pp2 x dp2 with EP2 inside each stage (or pp2 x tp2 with EP borrowing the tp ranks), with or
without FSDP2 and router losses, against one process that accumulates the same global
micro-batches.

The model (4 blocks) is split the torchtitan way: each stage is a full copy with the other
stages' modules deleted, so its names are the model's. ``ScheduleGPipe`` and ``Schedule1F1B`` run
2 stages (one per rank); ``ScheduleInterleaved1F1B`` and the zero-bubble V schedules run 4 (two
per rank, looped or V-shaped; the zero-bubble ones split each backward into input and weight
gradients). Two pipelines (dp ranks 0 and 1 of each stage) run the schedule on their halves of
every micro-batch; the experts of a stage exchange tokens across the two pipelines (EP over the
stage's dp ranks). Each test runs 3 steps of one fused AdamW over every stage module and mesh:
the losses and every param gradient of each step, the params after the last step and the
counters of every router must match the single-process run (plain AdamW) within 1e-5 relative
(fp32). With router losses the reference adds each micro-batch's collected losses to its loss
before dividing by the number of micro-batches; the pipeline runs them on the attach route (a
schedule computes the loss on the last stage only, so a collector on another stage has no loss
to add to), with the factor of a scaled loss given by ``set_router_loss_scale``
(``tests/test_pipeline_router_losses.py``), and the ``"global_batch"`` statistics are summed
over the stage's ranks for each micro-batch.

Shape legend: b sequences per micro-batch and dp rank, L tokens per sequence, D dim, V vocab.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
import unittest
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, MoEMeshes, build_moe_meshes, collect_aux_losses
from dtensor_moe.moe import load_stats, set_router_loss_scale
from dtensor_moe.moe.config import AuxLossType
from dtensor_moe.parallel import fully_shard_moe, parallelize_moe, reduce_gradients
from tests._dist import DistTestBase
from tests._moe_model import DIM, VOCAB, Block, moe_config
from tests.test_parallel_moe import close

N_MICRO, b, L, NUM_LAYERS = 4, 2, 6, 4
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


class PipeLM(nn.Module):
    """Embedding, blocks in a ModuleDict keyed by index, norm and head; a stage deletes what
    other stages hold (``None`` modules are skipped)."""

    def __init__(self, **config) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(moe_config(**config))
                                     for i in range(NUM_LAYERS)})
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


def stage_module(full: PipeLM, stage: int, num_stages: int) -> PipeLM:
    """Stage ``stage`` of ``num_stages``: its share of the layers, the embedding on the first
    stage and the norm and head on the last."""
    module = copy.deepcopy(full)
    per_stage = NUM_LAYERS // num_stages
    for i in range(NUM_LAYERS):
        if i // per_stage != stage:
            del module.layers[str(i)]
    if stage != 0:
        module.embed = None
    if stage != num_stages - 1:
        module.norm = module.head = None
    return module


def loss_fn(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.reshape(-1, VOCAB), targets_BL.reshape(-1))


def tokens(dp: int) -> torch.Tensor:
    """The global batch, dp rank d's part in rows ``d * N_MICRO * b`` onwards."""
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (dp * N_MICRO * b, L + 1), generator=gen)


def stages_of(pp_rank: int, pp: int, style: str) -> list[int]:
    """The stages a rank runs: one (``"single"``), or two placed ``"loop"`` (interleaved
    schedules) or ``"v"`` (zero-bubble V schedules) as torch's schedules expect."""
    if style == "single":
        return [pp_rank]
    return [pp_rank, pp_rank + pp] if style == "loop" else [pp_rank, 2 * pp - 1 - pp_rank]


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """One rank's part of the pipeline, next to the single-process reference model."""

    meshes: MoEMeshes
    indices: list[int]  # the stages this rank runs
    num_stages: int
    modules: list[nn.Module]
    schedule: object
    ref: PipeLM
    loss_factor: float = 1.0  # the schedule's loss_fn: this times the loss
    scaler_init: float | None = None

    def step(self, local: torch.Tensor, losses: list[torch.Tensor]) -> None:
        """One schedule step on this pipeline's rows of the global batch."""
        has_last = self.num_stages - 1 in self.indices
        targets = dict(target=local[:, 1:], losses=losses) if has_last else {}
        self.schedule.step(*([local[:, :-1]] if 0 in self.indices else []), **targets)


def reference_step(ref: PipeLM, T: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """The reference's grads for one step: the global micro-batch m is every dp rank's m-th
    chunk; each micro-batch's loss and collected router losses, divided by the number of
    micro-batches."""
    ref_losses = []
    for m in range(N_MICRO):
        rows = torch.cat([torch.arange(n * N_MICRO * b + m * b, n * N_MICRO * b + (m + 1) * b)
                          for n in range(dp)])
        with collect_aux_losses() as router_losses:
            logits = ref(T[rows, :-1])
        loss = loss_fn(logits, T[rows, 1:])
        ((loss + router_losses.total()) / N_MICRO).backward()
        ref_losses.append(loss.detach())
    return ref_losses


def build_pipeline(
    test: DistTestBase,
    schedule_cls,
    style: str,
    *,
    fsdp: bool | str = False,
    aux: AuxLossType | None = None,
    tp: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    divide: bool = False,
    mode: str = "attach",
    config: dict | None = None,
) -> Pipeline:
    """``aux``: the balance loss (with a z-loss) on the attach route, whose gradient the
    schedule's ``scale_grads`` averages over micro-batches; the reference collects it.
    ``fsdp``: FSDP2 in every stage (``True``) or in the first only (``"first"``).
    ``tp=2``: each stage's 2 ranks run Megatron-style TP of the blocks' MLP (no SP) and EP
    borrows them, one pipeline in all. ``scaler``: the schedule's loss is scaled by it.
    ``divide``: the ``loss_fn`` divides by the number of micro-batches and the schedule runs
    with ``scale_grads=False``. The attached router losses get the same factor on every stage
    (``set_router_loss_scale``). ``mode``: the stages' ``aux_loss_mode``. ``config``: more
    ``MoEConfig`` fields."""
    meshes = build_moe_meshes(pp=2, dp=2 // tp, ep=2, tp=tp, device_type="cpu")
    indices = stages_of(meshes.pp_rank, meshes.pp, style)
    num_stages = meshes.pp * len(indices)
    losses_config = dict(config or {})
    if aux is not None:
        losses_config.update(aux_loss_coeff=0.1, aux_loss_type=aux, z_loss_coeff=0.01)
    full = PipeLM(**losses_config, aux_loss_mode=mode)
    ref = PipeLM(**losses_config, aux_loss_mode="collect")
    meta = dict(device="meta")
    hidden = torch.empty(b, L, DIM, **meta, requires_grad=True)  # crosses stages with grad
    modules, stages = [], []
    for index in indices:
        module = stage_module(full, index, num_stages)
        for block in module.layers.values() if tp > 1 else ():
            parallelize_module(block, meshes.dense["tp"],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
        parallelize_moe(module, meshes, sequence_parallel=False)
        if fsdp is True or (fsdp == "first" and index == 0):  # a group per block
            fully_shard_moe(module, meshes, blocks=list(module.layers.values()),
                            reshard_after_forward=False)
        last = index == num_stages - 1
        stages.append(PipelineStage(
            module, index, num_stages, torch.device("cpu"),
            input_args=torch.empty(b, L, dtype=torch.long, **meta) if index == 0 else hidden,
            output_args=torch.empty(b, L, VOCAB, **meta, requires_grad=True) if last else hidden,
            group=meshes.pp_mesh.get_group(),
        ))
        if aux == "global_batch":  # per micro-batch: the statistics of the stage's ranks
            groups = {id(m.router.aux_loss_group) for m in module.modules() if isinstance(m, MoE)}
            test.assertEqual(groups, {id(meshes.stage_group)})
        modules.append(module)
    scaler_init = None if scaler is None else scaler.get_scale()
    factor = (1.0 if scaler is None else scaler_init) / (N_MICRO if divide else 1)
    if factor != 1.0:  # every stage, those without the loss too
        set_router_loss_scale(modules, factor)

    def stage_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits_BLV, targets_BL) / (N_MICRO if divide else 1)
        return loss if scaler is None else scaler.scale(loss)

    kwargs = dict(loss_fn=stage_loss, scale_grads=not divide)
    schedule = schedule_cls(stages[0] if style == "single" else stages, N_MICRO, **kwargs)
    return Pipeline(meshes=meshes, indices=indices, num_stages=num_stages, modules=modules,
                    schedule=schedule, ref=ref, loss_factor=factor, scaler_init=scaler_init)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_training(
    test: DistTestBase, schedule_cls, style: str, *, steps: int = 3, **options
) -> None:
    """``steps`` steps of one fused AdamW over every param of a rank's stage modules (every
    mesh): each step's losses and every param gradient, the counters of every router after
    the last step, and every param after it, against one process's plain AdamW on the same
    micro-batches. ``options``: of :func:`build_pipeline`; with a ``scaler``, the
    optimizer steps through it and the grads are compared unscaled. AdamW's eps is near the
    grads' size, so that its step depends on their scale (an unscaled, twice-scaled or
    missing gradient part shows), which it otherwise all but cancels."""
    pipe = build_pipeline(test, schedule_cls, style, **options)
    meshes, modules, ref = pipe.meshes, pipe.modules, pipe.ref
    fsdp, tp, scaler = options.get("fsdp", False), options.get("tp", 1), options.get("scaler")
    if scaler is not None:
        scaler.scale(torch.zeros(()))  # the stages without the loss need the scale too
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2,
                            eps=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)

    T = tokens(meshes.dp)
    d = meshes.dense.get_local_rank("dp")
    what = schedule_cls.__name__
    has_last = pipe.num_stages - 1 in pipe.indices
    names = {n for m in modules for n, _ in m.named_parameters()}
    test.assertTrue(any(".moe.experts." in n for n in names), names)
    if fsdp is False:  # (FSDP2 makes every param a DTensor)
        sharded = {n for m in modules for n, p in m.named_parameters()
                   if isinstance(p, DTensor)}
        test.assertEqual(tp > 1, any(n.endswith(".up.weight") for n in sharded), sharded)
    for step in range(steps):
        losses: list[torch.Tensor] = []
        pipe.step(T[d * N_MICRO * b : (d + 1) * N_MICRO * b], losses)
        ref_losses = reference_step(ref, T, meshes.dp)
        reduce_gradients(modules, meshes)  # the mean over the pipelines (stage's dp ranks)
        at = f"{what} step {step}"
        if has_last:  # the schedule's losses are those of its loss_fn
            got = torch.stack(losses).detach() / pipe.loss_factor
            dist.all_reduce(got, group=meshes.dense.get_group("dp"))
            close(got / meshes.dp, torch.stack(ref_losses), f"{at} losses")
        ref_params = dict(ref.named_parameters())
        grad_factor = 1.0 if scaler is None else scaler.get_scale()
        for module in modules:
            for name, param in module.named_parameters():
                test.assertIsNotNone(param.grad, f"{at} {name}")
                close(full(param.grad) / grad_factor, ref_params[name].grad, f"{at} {name}")
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    if scaler is not None:
        test.assertEqual(scaler.get_scale(), pipe.scaler_init)  # no step skipped
    ref_params = dict(ref.named_parameters())
    for module in modules:
        for name, param in module.named_parameters():
            close(full(param).detach(), ref_params[name].detach(), f"{what} after: {name}")
    # every token routed as in one process: the counters of every router agree
    stats = sorted(load_stats(modules, meshes=meshes), key=lambda layer: layer.name)
    test.assertEqual(stats, load_stats(ref, process_group="local"), what)
    test.assertEqual([s.name for s in stats], [f"layers.{i}.moe" for i in range(NUM_LAYERS)])


class PipelineScheduleTest(DistTestBase):
    def _check(self, schedule_cls, style: str, **options) -> None:
        check_training(self, schedule_cls, style, **options)

    @with_comms
    def test_gpipe(self):
        self._check(ScheduleGPipe, "single")

    # a repeat: 1F1B runs in CI with FSDP2 (test_1f1b_fsdp) and with FSDP2 in stage 0 only
    # (test_1f1b_fsdp_in_one_stage, whose stage 1 trains plain params), and the "single" style
    # without FSDP2 under GPipe (test_gpipe); DTENSOR_MOE_FULL_MATRIX=1 runs this one too
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_1f1b(self):
        self._check(Schedule1F1B, "single")

    @with_comms
    def test_interleaved_1f1b(self):
        self._check(ScheduleInterleaved1F1B, "loop")

    # a repeat: the same schedule without FSDP2 runs in CI in test_zero_bubble_v_tp (plus TP of
    # the dense layers), at pp2 x dp2 with EP2 in test_zero_bubble_v_fsdp, and the "v" style
    # without FSDP2 at pp2 x dp2 in test_dualpipe_v; DTENSOR_MOE_FULL_MATRIX=1 runs this one too
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_zero_bubble_v(self):
        # backward split into input and weight gradients (torch walks the autograd graph)
        self._check(ScheduleZBVZeroBubble, "v")

    @with_comms
    def test_dualpipe_v(self):
        self._check(ScheduleDualPipeV, "v")

    # FSDP2 inside each stage. reshard_after_forward=False: with True, torch 2.13's zero-bubble
    # V schedules leave some dense grads missing or wrong, also in a model without MoE layers
    @with_comms
    def test_1f1b_fsdp(self):
        self._check(Schedule1F1B, "single", fsdp=True)

    @with_comms
    def test_1f1b_fsdp_in_one_stage(self):
        # reduce_gradients: stage 0's grads reduced by FSDP2, stage 1's by the helper
        self._check(Schedule1F1B, "single", fsdp="first")

    @with_comms
    def test_zero_bubble_v_fsdp(self):
        self._check(ScheduleZBVZeroBubble, "v", fsdp=True)

    # a repeat: tests/test_pipeline_router_losses.py's test_1f1b_fsdp_grad_scaler_sequence_aux_loss
    # runs 1F1B with FSDP2 and a GradScaler (and the sequence losses); DTENSOR_MOE_FULL_MATRIX=1
    # runs this one too
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_1f1b_fsdp_grad_scaler(self):
        self._check(Schedule1F1B, "single", fsdp=True,
                    scaler=torch.amp.GradScaler("cpu", init_scale=16.0))

    @with_comms
    def test_zero_bubble_v_tp(self):
        self._check(ScheduleZBVZeroBubble, "v", tp=2)

    # repeats: tests/test_pipeline_router_losses.py runs the sequence losses under 1F1B (with
    # FSDP2 and a GradScaler) and the global-batch loss under ZBV (with a dividing loss_fn; and
    # undivided under GPipe); DTENSOR_MOE_FULL_MATRIX=1 runs these two too
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_1f1b_sequence_aux_loss(self):
        self._check(Schedule1F1B, "single", aux="sequence")

    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_zero_bubble_v_global_batch_aux_loss(self):
        self._check(ScheduleZBVZeroBubble, "v", aux="global_batch")

    # DTENSOR_MOE_FULL_MATRIX=1: FSDP2 with a GradScaler, and TP of the dense layers, under the
    # schedules whose CI tests above run without them
    if FULL:

        @with_comms
        def test_every_schedule_with_fsdp_grad_scaler_and_tp(self):
            schedules = ((ScheduleGPipe, "single"), (ScheduleInterleaved1F1B, "loop"),
                         (ScheduleDualPipeV, "v"), (Schedule1F1B, "single"))
            for schedule_cls, style in schedules:
                self._check(schedule_cls, style, fsdp=True,
                            scaler=torch.amp.GradScaler("cpu", init_scale=16.0))
                self._check(schedule_cls, style, tp=2)


if __name__ == "__main__":
    run_tests()
