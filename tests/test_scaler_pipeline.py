"""GradScaler over pipeline stages (gloo, 4 ranks): one skip-or-step decision on every rank.

Ranks {0, 1} are stage 0 and ranks {2, 3} stage 1 of a ``("pp", "dp")`` mesh. Each stage's
params live on its own ``"dp"`` submesh, so the two stages see different meshes; every rank
steps its own fused AdamW under its own GradScaler, as under a pipeline schedule. The reference
is the whole model (both stages' params) in one process, with one plain AdamW and one
GradScaler: an inf in one stage skips the step of both. See Note [GradScaler across meshes].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal import common_distributed
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe  # noqa: F401  (registers the handlers)
from dtensor_moe.optim import GradScaler
from tests._dist import DistTestBase

# A hang (ranks issuing different collectives) fails the test after this many seconds instead
# of blocking CI for the default 300; each test takes about 2 s.
_TIMEOUT_S = 45
_TESTS = (
    "test_plain_stage_and_ep_stage_agree",
    "test_stages_on_different_meshes_agree",
    "test_world_mesh_on_one_stage_only_agrees",
    "test_out_of_step_ranks_raise",
)
common_distributed.TIMEOUT_OVERRIDE.update(dict.fromkeys(_TESTS, _TIMEOUT_S))

# stage -> [(shape, placements on the stage's "dp" mesh)]
STAGES = {
    0: [((4, 3), [Shard(0)]), ((5,), [Replicate()])],
    1: [((2, 6), [Shard(1)]), ((4, 4), [Shard(0)])],
}
INF_STEP = 1  # the step at which rank 0's shard of stage 0's first grad holds an inf
STEPS = 3
INIT_SCALE = 8.0


def _full_params(stage: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + stage)
    return [torch.randn(shape, generator=gen) for shape, _ in STAGES[stage]]


def _full_grads(stage: int, step: int, scale: float) -> list[torch.Tensor]:
    """The grads of ``scale * loss`` (what backward of a scaled loss produces)."""
    gen = torch.Generator().manual_seed(100 * step + stage)
    grads = [torch.randn(shape, generator=gen) * scale for shape, _ in STAGES[stage]]
    if step == INF_STEP and stage == 0:
        grads[0][0, 0] = float("inf")  # row 0 of a Shard(0) param: only rank 0 holds it
    return grads


def _scaled_step(scaler, opt, params, grads) -> None:
    scaler.scale(torch.ones(()))  # initializes the scale, as scaler.scale(loss) would
    for p, g in zip(params, grads):
        p.grad = g
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _reference() -> tuple[list[list[torch.Tensor]], list[float]]:
    """Both stages in one process: params per stage after STEPS steps, and the scales."""
    params = {s: [p.requires_grad_() for p in _full_params(s)] for s in STAGES}
    opt = torch.optim.AdamW([*params[0], *params[1]], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scales = []
    for step in range(STEPS):
        scale = scaler.get_scale()
        grads = [*_full_grads(0, step, scale), *_full_grads(1, step, scale)]
        _scaled_step(scaler, opt, [*params[0], *params[1]], grads)
        scales.append(scaler.get_scale())
    return [[p.detach() for p in params[s]] for s in STAGES], scales


class GradScalerPipelineTest(DistTestBase):
    def _stage_mesh(self):
        mesh = init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("pp", "dp"))
        return self.rank // 2, mesh["dp"], mesh

    def _run_stage(self, extra_world_param: bool):
        """STEPS scaler steps of this rank's stage; returns (full params, scales, stepped)."""
        stage, stage_mesh, world_mesh = self._stage_mesh()
        params = [
            distribute_tensor(t, stage_mesh, pl, src_data_rank=None).requires_grad_()
            for t, (_, pl) in zip(_full_params(stage), STAGES[stage])
        ]
        extra = []
        if extra_world_param and stage == 0:
            # stage 0 alone also holds a (zero-grad) param on the whole ("pp", "dp") mesh; no
            # collective creates it
            local = torch.zeros(3, requires_grad=True)
            extra = [DTensor.from_local(local, world_mesh, [Replicate(), Replicate()],
                                        run_check=False).detach().requires_grad_()]
        opt = torch.optim.AdamW([*params, *extra], lr=0.1, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        scales, stepped = [], []
        for step in range(STEPS):
            before = [p.detach().to_local().clone() for p in params]
            grads = [
                distribute_tensor(g, stage_mesh, pl, src_data_rank=None)
                for g, (_, pl) in zip(_full_grads(stage, step, scaler.get_scale()), STAGES[stage])
            ]
            grads += [torch.zeros_like(p) for p in extra]
            _scaled_step(scaler, opt, [*params, *extra], grads)
            scales.append(scaler.get_scale())
            stepped.append(any(not torch.equal(p.detach().to_local(), b)
                               for p, b in zip(params, before)))
        return stage, [p.detach().full_tensor() for p in params], scales, stepped

    def _check_against_reference(self, extra_world_param: bool) -> None:
        stage, params, scales, stepped = self._run_stage(extra_world_param)
        decisions = [None] * self.world_size
        dist.all_gather_object(decisions, (scales, stepped))
        want_stepped = [step != INF_STEP for step in range(STEPS)]
        ref_params, ref_scales = _reference()
        self.assertEqual(ref_scales, [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2])
        self.assertEqual(decisions, [(ref_scales, want_stepped)] * self.world_size)
        for got, want in zip(params, ref_params[stage]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    @with_comms
    def test_stages_on_different_meshes_agree(self):
        """An inf on rank 0 (stage 0) makes all four ranks skip, as the whole model would."""
        self._check_against_reference(extra_world_param=False)

    @with_comms
    def test_world_mesh_on_one_stage_only_agrees(self):
        """Stage 0's meshes cover the world, stage 1's do not: still one decision, no hang."""
        self._check_against_reference(extra_world_param=True)

    @with_comms
    def test_out_of_step_ranks_raise(self):
        """Stage 0 holds fp32 and fp64 grads (two checks per unscale_), stage 1 fp32 only:
        outside the contract, and every rank raises instead of drifting apart."""
        stage, stage_mesh, _ = self._stage_mesh()
        dtypes = (torch.float32, torch.float64) if stage == 0 else (torch.float32,)
        params = [
            distribute_tensor(torch.ones(4, dtype=dt), stage_mesh, [Shard(0)]).requires_grad_()
            for dt in dtypes
        ]
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        with self.assertRaisesRegex(
            ValueError,
            r"out of step in the inf check: this rank is at unscale_ call \d, dtype group \d; "
            r"across the ranks the unscale_ call ranges over 1\.\.2 and the dtype group over "
            r"1\.\.2\. Every rank must call scaler.unscale_/step for the same optimizers",
        ):
            for _ in range(2):
                _scaled_step(scaler, opt, params, [torch.ones_like(p) for p in params])

    @with_comms
    def test_plain_stage_and_ep_stage_agree(self):
        """pp2: stage 0 holds plain params (no FSDP2, no EP), stage 1 an expert weight sharded
        on "ep"; fused AdamW under dtensor_moe's GradScaler. An inf in stage 0's plain grad on
        one step makes all four ranks skip and halve the scale, as the whole model in one
        process would; one all-reduce per step on every rank. (torch's GradScaler hangs here:
        stage 0 never reaches the DTensor handler's all-reduce.) A rank whose optimizer holds
        no grad makes every rank raise."""
        meshes = dtensor_moe.build_moe_meshes(pp=2, dp=2, ep=2)
        stage = meshes.pp_rank
        full = _full_params(stage)
        if stage == 0:
            params = [t.clone().requires_grad_() for t in full]
        else:
            mesh = meshes.expert["ep"]
            params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
                      for t in full]  # fmt: skip
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        scaler = GradScaler("cpu", init_scale=INIT_SCALE)
        scales = []
        for step in range(STEPS):
            grads = _full_grads(stage, step, scaler.get_scale())
            if stage == 0 and step == INF_STEP:
                grads[0][0, 0] = 1.0 if self.rank == 1 else grads[0][0, 0]  # inf on rank 0 only
            if stage == 1:
                grads = [distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
                         for g in grads]  # fmt: skip
            with CommDebugMode() as mode:
                _scaled_step(scaler, opt, params, grads)
            counts = {str(k): v for k, v in mode.get_comm_counts().items()}
            self.assertEqual(counts, {"c10d.allreduce_": 1})
            scales.append(scaler.get_scale())
        every = [None] * self.world_size
        dist.all_gather_object(every, scales)
        ref_params, ref_scales = _reference()
        self.assertEqual(every, [ref_scales] * self.world_size)
        got = [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]
        for g, want in zip(got, ref_params[stage]):  # rank 1 skipped the step as well
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        # a rank whose optimizer holds no grad: every rank raises after the one all-reduce
        opt.zero_grad(set_to_none=True)
        grads = [torch.ones_like(p) for p in params] if self.rank != 3 else None
        scaler.scale(torch.ones(()))
        if grads is not None:
            for p, g in zip(params, grads):
                p.grad = g
        with self.assertRaisesRegex(
            ValueError,
            rf"GradScaler: the optimizer holds no grad on {'this' if self.rank == 3 else 'another'}"
            r" rank, so that rank has nothing to check for inf; every rank must step an "
            "optimizer with at least one grad",
        ):
            scaler.step(opt)


if __name__ == "__main__":
    run_tests()
