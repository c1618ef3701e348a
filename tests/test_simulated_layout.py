"""16 and 32 ranks in one process: two MoE layers at pp2 x dp2 x ep4 (and pp2 x dp4 x EP2 x
expert TP2, pp2 x dp2 x ep8), against one process.

The layouts run on torch's threaded process group (``tests/_threaded_world.py``): one thread
of this process per rank, with real data in every collective. The package runs
unmodified: the count exchange and its host read, the variable-split ``all_to_all_single``
exchanges (forward and backward), DTensor's redistributes and the functional collectives of the
identical-tokens check. Stage ``s`` of ``build_moe_meshes(pp=2, ...)`` holds MoE layer ``s``;
the activation crosses the stages over ``meshes.pp_mesh`` (a broadcast from the sending rank of
the two-rank pp group, forward, and back for the gradient), as a pipeline schedule with one
micro-batch would send it.

The reference is one process: the same two layers (same weights) on the whole global batch,
``y = layer1(layer0(X))``, loss ``sum(y * G)``. Every rank's output shard and input gradient
shard, and every parameter gradient of both layers reduced as ``docs/parallelism.md`` says
(routed experts: gathered over ``ep`` and ``etp``, summed over ``edp``; the router and shared
experts: summed over tp under sequence parallelism, then over ``dp``), match it within 1e-5
(relative, fp32).

Why not ``LocalTensorMode`` or the fake process group: see "Beyond this machine" in
``docs/pipeline.md``; the fake group's meshes at 16 and 32 ranks are in
``tests/test_pipeline_mesh.py``.

Shape legend: B sequences per data shard, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dtensor_moe import MoE, MoEConfig, build_moe_meshes, parallelize_moe
from tests._threaded_world import run_ranks

PP = 2
D, H, E = 16, 32, 8
B, L = 2, 7  # L = 7 over tp = 4: shards of 2, 2, 2 and 1 tokens; over tp = 8: one rank has none
TOL = 1e-5


@dataclass(frozen=True)
class Layout:
    """One stage's degrees; ``tp > 1`` runs sequence parallelism, with EP borrowing the tp
    ranks unless ``expert_tp``."""

    dp: int
    ep: int
    tp: int = 1
    expert_tp: bool = False

    @property
    def stage(self) -> int:
        return self.dp * self.tp

    @property
    def world(self) -> int:
        return PP * self.stage

    @property
    def etp(self) -> int:
        return self.tp if self.expert_tp else 1

    @property
    def edp(self) -> int:
        return self.stage // (self.ep * self.etp)


LAYOUTS = {
    # per stage: EP4 over the data ranks, two copies of every expert (edp2 x ep4)
    "pp2_edp2_ep4": Layout(dp=8, ep=4),
    # per stage: dp2 x SP4, EP4 over each tp group
    "pp2_dp2_sp4_ep4": Layout(dp=2, ep=4, tp=4),
    # per stage: dp4 x SP2, EP2 x expert TP2 (each row sent to both hidden-dim slices)
    "pp2_dp4_sp2_ep2_etp2": Layout(dp=4, ep=2, tp=2, expert_tp=True),
    # 32 ranks; per stage: dp2 x SP8, EP8 over each tp group; a rank of each tp group gets no
    # token (L = 7 < tp)
    "pp2_dp2_sp8_ep8": Layout(dp=2, ep=8, tp=8),
}
# (layout, ep_overlap): the overlapped exchange on every layout, the plain one on
# pp2_edp2_ep4; DTENSOR_MOE_FULL_MATRIX=1 adds the plain one on the others (the same plain path
# runs at 16 ranks on pp2_edp2_ep4, and on every 4-rank layout in tests/test_parallel_moe.py)
CASES = [(name, overlap) for name in LAYOUTS for overlap in (True, False)]
if os.environ.get("DTENSOR_MOE_FULL_MATRIX") != "1":
    for name in ("pp2_dp2_sp4_ep4", "pp2_dp4_sp2_ep2_etp2", "pp2_dp2_sp8_ep8"):
        CASES.remove((name, False))


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Within 1e-5 relative, elementwise or to the tensor's largest magnitude."""
    atol = TOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=atol, msg=lambda m: f"{msg}\n{m}")


def token_slices(tp: int) -> list[slice]:
    """The sequence shards of ``L`` tokens over ``tp`` ranks, as ``torch.chunk`` cuts them."""
    bounds, start = [], 0
    for chunk in torch.arange(L).chunk(tp):
        bounds.append(slice(start, start + chunk.numel()))
        start += chunk.numel()
    return bounds + [slice(L, L)] * (tp - len(bounds))


class Reference:
    """The two layers in one process on the global batch, forward and backward."""

    def __init__(self, layout: Layout) -> None:
        torch.manual_seed(0)
        config = MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=2, num_shared_experts=1,
                           init_std=0.3)  # fmt: skip
        self.layers = [MoE(config) for _ in range(PP)]
        self.initial = copy.deepcopy(self.layers)  # what each rank parallelizes: no grads
        self.X = torch.randn(layout.dp * B, L, D)
        self.G = torch.randn(layout.dp * B, L, D)
        x = self.X.clone().requires_grad_()
        h = self.layers[0](x)
        h.retain_grad()
        y = self.layers[1](h)
        (y * self.G).sum().backward()
        self.outputs = [h.detach(), y.detach()]  # of stage 0, stage 1
        self.input_grads = [x.grad, h.grad]


def run_rank(rank: int, layout: Layout, ref: Reference, overlap: bool) -> dict:
    """One rank: its stage's layer on its shard; the activation and its gradient cross the
    stages over the pp mesh. Returns its output and input-gradient shards and its grads."""
    meshes = build_moe_meshes(
        pp=PP, dp=layout.dp, ep=layout.ep, tp=layout.tp, expert_tp=layout.expert_tp
    )
    stage = meshes.pp_rank
    layer = parallelize_moe(
        copy.deepcopy(ref.initial[stage]), meshes, sequence_parallel=layout.tp > 1,
        ep_overlap=overlap,
    )  # fmt: skip
    dp_i, tp_i = divmod(rank - meshes.stage_ranks[0], layout.tp)
    rows, cols = slice(dp_i * B, (dp_i + 1) * B), token_slices(layout.tp)[tp_i]

    def forward(x_local: torch.Tensor) -> torch.Tensor:
        if layout.tp == 1:
            return layer(x_local)
        x = DTensor.from_local(
            x_local, meshes.dense["tp"], [Shard(1)], shape=(B, L, D), stride=(L * D, D, 1)
        )
        return layer(x).to_local()

    group = meshes.pp_mesh.get_group()
    sender, receiver = meshes.pp_mesh.mesh.tolist()  # this position in stage 0 and stage 1
    if stage == 0:
        x_local = ref.X[rows, cols].clone().requires_grad_()
        out = forward(x_local)
        dist.broadcast(out.detach().clone(), src=sender, group=group)
        grad = torch.empty_like(out)
        dist.broadcast(grad, src=receiver, group=group)
        out.backward(grad)
    else:
        received = torch.empty(B, cols.stop - cols.start, D)
        dist.broadcast(received, src=sender, group=group)
        x_local = received.requires_grad_()
        out = forward(x_local)
        (out * ref.G[rows, cols]).sum().backward()
        dist.broadcast(x_local.grad.clone(), src=receiver, group=group)

    grads = {}
    for name, param in layer.named_parameters():
        # Routed experts: sharded over ep (and etp), complete for the tokens of their edp
        # group. Under SP a replicated weight's grad is Partial over tp. Gathered whole here.
        grads[name] = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    return {"out": out.detach(), "in_grad": x_local.grad, "grads": grads,
            "where": (stage, rows, cols)}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "overlap"), CASES, ids=[f"{n}-{'overlap' if o else 'plain'}" for n, o in CASES]
)
def test_layout_matches_one_process(name: str, overlap: bool) -> None:
    layout = LAYOUTS[name]
    ref = Reference(layout)
    results = run_ranks(layout.world, lambda rank: run_rank(rank, layout, ref, overlap))
    assert sorted(results) == list(range(layout.world))

    for rank, res in results.items():
        stage, rows, cols = res["where"]
        assert stage == rank // layout.stage, (rank, stage)
        what = f"{name} overlap={overlap} rank {rank} (stage {stage}, rows {rows}, tokens {cols})"
        close(res["out"], ref.outputs[stage][rows, cols], f"{what}: output")
        close(res["in_grad"], ref.input_grads[stage][rows, cols], f"{what}: input grad")

    for stage, ref_layer in enumerate(ref.layers):
        # the stage's ranks: first + (edp_i * ep + ep_i) * etp + etp_i = first + dp_i * tp + tp_i
        first = stage * layout.stage
        for pname, param in ref_layer.named_parameters():
            what = f"{name} overlap={overlap} stage {stage}: {pname}.grad"
            if pname.startswith("experts."):  # summed over edp (ep_i = etp_i = 0 of each)
                step, copies = layout.ep * layout.etp, layout.edp
            else:  # summed over dp (tp_i = 0 of each)
                step, copies = layout.tp, layout.dp
            got = sum(results[first + d * step]["grads"][pname] for d in range(copies))
            close(got, param.grad, what)
