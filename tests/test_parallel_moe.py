"""Parity of the parallel MoE layouts with the single-device layer (4 gloo ranks).

Every layout runs the same global batch as one single-device ``MoE`` with the same weights and
checks, at 1e-5 relative in fp32, for 3 training steps (fused AdamW, expert-bias update):
the output, the input gradient, every parameter gradient (reduced as ``docs/parallelism.md``
says), the auxiliary-loss value, the expert bias, and after the steps every parameter.

The global batch is ``dp`` data shards of ``B`` sequences; data-parallel rank ``d`` holds shard
``d``. The objective is the mean over data shards (the usual data-parallel loss), so the
reference loss is ``sum(y * G) / dp`` plus its collected auxiliary loss (which is the mean of
the shards' ones), a rank's loss is ``sum(y_d * G_d)`` plus what its forward collected, and a
rank's gradient, summed over the documented groups, is divided by ``dp``.

Matrix: layouts x B in {1, 2} x L in {8 (divisible), 7 (not divisible), 1 (fewer
tokens than ranks: a tp rank with zero tokens)} x top_k in {1, 2} x shared experts {0, 1}.
The CI subset, ``CI_CASES``, runs three cases per layout that together take every value of
every axis, on the overlapped exchange (the default); the plain exchange (``overlap=False``) runs
the first of them, and a test's second layout (the "gather" dispatch, EP over tp and dp ranks)
runs the first case on both. ``DTENSOR_MOE_FULL_MATRIX=1`` runs the whole product on both
exchange paths.

Shape legend: B sequences per data shard, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe  # noqa: F401  (registers the fused optimizer handlers)
from dtensor_moe import MoE, MoEConfig
from dtensor_moe.moe import update_expert_bias
from dtensor_moe.moe.balance import collect_aux_losses
from dtensor_moe.parallel import MoEMeshes, build_moe_meshes, parallelize_moe
from tests._dist import DistTestBase

D, H, E = 16, 32, 8
TOL = 1e-5
STEPS = 3
LR = 1e-2
# AdamW's eps. Its first step moves a param by lr * g / (|g| + eps): an element whose gradient
# cancels to near zero (ep2 B=2 L=7 top_k=1 shared=1, experts.w1[0, 1, 14]: four token
# contributions of |c| ~ 0.05 summing to 2.3e-7) takes a step whose size depends on the rounding of
# that sum, d(step)/dg = lr * eps / (|g| + eps)^2, up to lr / eps. With torch's eps=1e-8 the
# 1.4e-8 that summing own and received rows apart (the overlapped exchange) changes in that
# element moved the param by 2.7e-5 (1e-2 * 2.7e-3), over TOL * max|w1|, though the gradient
# matched within 4e-9 of its max. At 1e-3, lr / eps = 10 bounds what fp32 reordering of a
# gradient (compared directly at every step) can do to a param, as the nonzero Adagrad
# accumulator does in tests/test_fsdp_moe.py; elements with |g| >> 1e-3 step as with the default.
EPS = 1e-3
BIAS_RATE = 1e-2


@dataclass(frozen=True)
class Layout:
    meshes: dict
    sequence_parallel: bool
    expert_tp_dispatch: str = "all_to_all"


LAYOUTS = {
    "ep2": Layout({"dp": 4, "ep": 2}, False),  # EP over data ranks, edp 2
    "ep4": Layout({"dp": 4, "ep": 4}, False),  # dp2ep
    "etp2": Layout({"dp": 2, "ep": 1, "tp": 2, "expert_tp": True}, True),  # expert TP, SP input
    "etp2_gather": Layout({"dp": 2, "ep": 1, "tp": 2, "expert_tp": True}, False, "gather"),
    "ep2tp2": Layout({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, True),  # EP x TP
    "ep2tp2_gather": Layout({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, True, "gather"),
    "sp2ep2": Layout({"dp": 2, "ep": 2, "tp": 2}, True),  # SP2, EP borrows TP
    "tp2ep2": Layout({"dp": 2, "ep": 2, "tp": 2}, False),  # TP2 (Replicate input), EP borrows TP
    "sp2ep4": Layout({"dp": 2, "ep": 4, "tp": 2}, True),  # SP2, EP over tp and dp ranks
}


@dataclass(frozen=True)
class Case:
    B: int
    L: int
    top_k: int
    shared: int

    def __str__(self) -> str:
        return f"B={self.B} L={self.L} top_k={self.top_k} shared={self.shared}"


FULL_MATRIX = [Case(*c) for c in itertools.product((1, 2), (8, 7, 1), (1, 2), (0, 1))]
CI_CASES = [Case(2, 7, 2, 1), Case(1, 1, 1, 0), Case(1, 8, 2, 0)]
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
CASES = FULL_MATRIX if FULL else CI_CASES


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Within 1e-5 relative, elementwise or to the tensor's largest magnitude."""
    atol = TOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=atol, msg=lambda m: f"{msg}\n{m}")


def make_config(case: Case, **overrides) -> MoEConfig:
    fields = dict(
        dim=D,
        hidden_dim=H,
        num_experts=E,
        top_k=case.top_k,
        num_shared_experts=case.shared,
        aux_loss_coeff=0.1,
        # the automatic route, for callers that add no collected loss (test_parallel_styles,
        # test_parallel_compile); ParallelRun collects, which a collector does in either mode
        aux_loss_mode="attach",
        use_expert_bias=True,
        init_std=0.3,
    )
    fields.update(overrides)
    return MoEConfig(**fields)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def is_routed_expert(name: str) -> bool:
    return name.startswith("experts.")


def reduce_grad(name: str, param: torch.Tensor, meshes: MoEMeshes) -> torch.Tensor:
    """The documented reduction of ``param.grad``, as a plain local tensor in param's layout.

    Routed experts: the DTensor grad on (ep[, etp]) is complete; sum over ``edp``. Everything
    else: redistribute to the param's placements (a ``Partial`` grad is summed over tp), then
    sum over ``dp``. Divided by ``dp``: the objective is the mean over data shards.
    """
    grad = param.grad
    if isinstance(grad, DTensor):
        grad = grad.redistribute(placements=param.placements).to_local()
    grad = grad.clone()
    dim = "edp" if is_routed_expert(name) else "dp"
    mesh = meshes.expert if is_routed_expert(name) else meshes.dense
    dist.all_reduce(grad, group=mesh.get_group(dim))
    return grad / meshes.dp


def as_param_grad(param: torch.Tensor, local_grad: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local_grad,
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
        )
    return local_grad


class ParallelRun:
    """One layout x case: the distributed model next to its single-device reference."""

    def __init__(
        self,
        layout: Layout,
        case: Case,
        rank: int,
        overlap: bool = True,
        prepare=None,
        exchange: str = "all_to_all",
        **config,
    ) -> None:
        """``prepare(moe)``, if given, changes the reference layer (an adapter swap, a wrapper)
        before the copy that the styles parallelize."""
        self.layout, self.case = layout, case
        self.meshes = build_moe_meshes(**layout.meshes, device_type="cpu")
        torch.manual_seed(0)
        self.ref = MoE(make_config(case, **config))
        if prepare is not None:
            prepare(self.ref)
        self.model = parallelize_moe(
            copy.deepcopy(self.ref),
            self.meshes,
            sequence_parallel=layout.sequence_parallel,
            expert_tp_dispatch=layout.expert_tp_dispatch,
            exchange=exchange,
            ep_overlap=overlap,
        )
        dp, B = self.meshes.dp, case.B
        self.X = torch.randn(dp * B, case.L, D)
        self.G = torch.randn(dp * B, case.L, D)
        self.shard = slice((rank // self.meshes.tp) * B, (rank // self.meshes.tp + 1) * B)
        self.opt_ref = torch.optim.AdamW(self.ref.parameters(), lr=LR, eps=EPS, fused=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, eps=EPS, fused=True)

    def _placement(self):
        return [Shard(1) if self.layout.sequence_parallel else Replicate()]

    def forward_backward(self) -> dict[str, torch.Tensor]:
        """Run one step's forward and backward on both; return what to compare."""
        x_ref = self.X.clone().requires_grad_()
        y_ref = self.reference_forward_backward(x_ref)
        y, x_grad = self.distributed_forward_backward()
        return {
            "y": (y, y_ref[self.shard].detach()),
            "x.grad": (x_grad, x_ref.grad[self.shard]),
        }

    def reference_forward_backward(self, x_ref: torch.Tensor) -> torch.Tensor:
        """The single-device layer on the global batch, and its backward; returns its output."""
        with collect_aux_losses() as aux_ref:
            y_ref = self.ref(x_ref)
        # mean over data shards of (sum(y_d * G_d) + aux_d); the global aux is that mean
        ((y_ref * self.G).sum().div(self.meshes.dp) + aux_ref.total()).backward()
        return y_ref

    def distributed_forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's data shard through the parallel layer; its full output and input grad."""
        x_d, g_d = self.X[self.shard], self.G[self.shard]
        if self.meshes.tp > 1:
            tp_mesh = self.meshes.dense["tp"]
            x = distribute_tensor(x_d, tp_mesh, self._placement()).requires_grad_()
            g_local = distribute_tensor(g_d, tp_mesh, self._placement()).to_local()
            with collect_aux_losses() as aux:  # a tp rank's share of its shard's aux loss
                y = self.model(x)
            ((y.to_local() * g_local).sum() + aux.total()).backward()
        else:
            x = x_d.clone().requires_grad_()
            with collect_aux_losses() as aux:
                y = self.model(x)
            ((y * g_d).sum() + aux.total()).backward()
        return full(y), full(x.grad) / self.meshes.dp

    def step(self, check) -> None:
        for name, (actual, expected) in self.forward_backward().items():
            check(actual, expected, name)
        ref_params = dict(self.ref.named_parameters())
        for name, param in self.model.named_parameters():
            local = reduce_grad(name, param, self.meshes)
            param.grad = as_param_grad(param, local)
            check(full(param.grad), ref_params[name].grad, f"{name}.grad")
        if self.ref.config.aux_loss_coeff > 0:
            aux = self.model.router.last_aux_loss.clone()
            dist.all_reduce(aux, group=self.meshes.dense.get_group("dp"))
            check(aux / self.meshes.dp, self.ref.router.last_aux_loss, "aux loss")
        self.opt.step()
        self.opt_ref.step()
        self.opt.zero_grad()
        self.opt_ref.zero_grad()
        update_expert_bias(self.model, BIAS_RATE, process_group=dist.group.WORLD)
        update_expert_bias(self.ref, BIAS_RATE)
        check(self.model.router.expert_bias, self.ref.router.expert_bias, "expert bias")

    def check_params(self, check) -> None:
        ref_params = dict(self.ref.named_parameters())
        for name, param in self.model.named_parameters():
            check(full(param).detach(), ref_params[name].detach(), f"param {name}")


OPTION_RUNS = [  # other MoEConfig options, one case each: (layout, overrides)
    ("ep4", {"pad_multiple": 4, "score_before_experts": True}),  # dispatch/combine path
    ("ep2tp2", {"score_before_experts": True, "score_func": "sigmoid", "route_norm": True}),
    ("sp2ep2", {"num_expert_groups": 4, "num_limited_groups": 2, "route_scale": 2.0}),
    ("tp2ep2", {"pad_multiple": 8, "compute_path": "loop"}),
    ("ep2", {"compute_path": "loop"}),  # overlapped exchange without the fused grouped_mm stage
    ("sp2ep2", {"shared_expert_gate": True}),  # gated shared expert, split routing
    ("tp2ep2", {"shared_expert_gate": True}),  # gated shared expert, replicate routing (TP)
    ("ep4", {"hidden_dim": 8}),  # H < D: the combine weights scale the SwiGLU products
]


def plain_in_ci(overrides: dict) -> bool:
    """Whether CI runs an option run on the plain exchange (``overlap=False``) as well as on
    the overlapped one: for the options that change the rows it moves (padding, with scores
    before the experts and with the loop path; H < D). The plain path of the routing-only
    options, and of ep2's loop (which is about the overlapped exchange), is the code that each
    layout's own test runs on the plain exchange; DTENSOR_MOE_FULL_MATRIX=1 runs both paths on
    every option run."""
    return "pad_multiple" in overrides or "hidden_dim" in overrides


def run_steps(run: ParallelRun, where: str) -> None:
    """``STEPS`` training steps of ``run``, every comparison at ``TOL``, then the params."""
    for step in range(STEPS):

        def check(actual, expected, what, step=step):
            close(actual, expected, f"{where} step {step}: {what}")

        run.step(check)
    run.check_params(lambda a, e, w: close(a, e, f"{where}: {w}"))


def layout_runs(cases, second: bool = False, plain: bool = True) -> list[tuple[bool, Case]]:
    """The (overlap, case) runs of one layout. Both settings of ExpertParallel(overlap=...):
    the own rows computed while the other rows' outputs travel, and every row through the
    exchange. ``DTENSOR_MOE_FULL_MATRIX=1``: both on every case. CI: the overlapped path (the
    default) on every case and the plain one on the first (``plain=False``: none); a test's
    ``second`` layout, the first case on both paths (its other cases and plain runs repeat the
    first layout's code path, which CI runs on every case)."""
    if FULL:
        return list(itertools.product((True, False), cases))
    if second:
        cases = cases[:1]
    return [(True, case) for case in cases] + ([(False, cases[0])] if plain else [])


class ParallelMoEParityTest(DistTestBase):
    def _run_layout(self, name: str, cases=None, second=False, plain=True, **config) -> None:
        for overlap, case in layout_runs(cases or CASES, second, plain):
            run = ParallelRun(LAYOUTS[name], case, self.rank, overlap=overlap, **config)
            run_steps(run, f"{name} {case} overlap={overlap} {config}")

    @with_comms
    def test_ep2(self):
        self._run_layout("ep2")

    @with_comms
    def test_ep4_dp2ep(self):
        self._run_layout("ep4")

    @with_comms
    def test_expert_tp2(self):
        self._run_layout("etp2")
        self._run_layout("etp2_gather", second=True)

    @with_comms
    def test_ep2_x_tp2(self):
        self._run_layout("ep2tp2")
        self._run_layout("ep2tp2_gather", second=True)

    @with_comms
    def test_sp2_ep_borrows_tp(self):
        self._run_layout("sp2ep2")
        self._run_layout("sp2ep4", second=True)

    @with_comms
    def test_tp2_replicate_input_ep_borrows_tp(self):
        self._run_layout("tp2ep2")

    @with_comms
    def test_config_options(self):
        for name, overrides in OPTION_RUNS:
            self._run_layout(name, [Case(2, 7, 2, 1)], plain=plain_in_ci(overrides), **overrides)

    @with_comms
    def test_all_gather_exchange(self):
        """``exchange="all_gather"`` (Note [All-gather exchange] in ``routed/all_gather.py``) on
        every EP layout, on the case that takes uneven shards, batch > 1, top-2 and a shared
        expert (the whole matrix under ``DTENSOR_MOE_FULL_MATRIX=1``), and with the options that
        change its dispatch: padding, scores before the experts, the loop path with ``H < D``.
        Capacity and pipeline schedules: ``tests/test_exchange_backends.py``."""
        cases = CASES if CASES is FULL_MATRIX else [Case(2, 7, 2, 1)]
        for name, case in itertools.product(AG_LAYOUTS if FULL else AG_CI_LAYOUTS, cases):
            run = ParallelRun(LAYOUTS[name], case, self.rank, exchange="all_gather")
            run_steps(run, f"{name} {case} all_gather")
        for name, overrides in AG_OPTION_RUNS:
            run = ParallelRun(LAYOUTS[name], Case(2, 7, 2, 1), self.rank, exchange="all_gather",
                              **overrides)  # fmt: skip
            run_steps(run, f"{name} all_gather {overrides}")


AG_LAYOUTS = ("ep2", "ep4", "ep2tp2", "ep2tp2_gather", "sp2ep2", "sp2ep4", "tp2ep2")
# CI leaves out the second layouts of ep2tp2 and sp2ep2 (the "gather" dispatch, EP over tp and
# dp ranks): their all-gather exchange is the code that ep2tp2 and sp2ep2 run here, and the
# layouts themselves run in test_ep2_x_tp2 and test_sp2_ep_borrows_tp.
# DTENSOR_MOE_FULL_MATRIX=1 runs the all-gather exchange on them too.
AG_CI_LAYOUTS = ("ep2", "ep4", "ep2tp2", "sp2ep2", "tp2ep2")
AG_OPTION_RUNS = [
    ("ep4", {"pad_multiple": 4, "score_before_experts": True}),
    ("ep2", {"compute_path": "loop", "hidden_dim": 8}),
]


if __name__ == "__main__":
    run_tests()
