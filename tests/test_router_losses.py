"""The router z-loss and the global-batch balance loss (Note [Router loss shares]).

One process: the layer's loss, collected by ``collect_aux_losses()`` and added to the user's
loss, against ``loss + aux + z`` written out here token by token (the z-loss from the gate
logits, the global-batch balance loss from the scores and selections over the whole batch):
gate, expert and input gradients, the logged values, under ``loss / n``. Four gloo ranks: EP4,
SP2+EP2, TP2+EP2 (Replicate input) and expert TP2 ("replicate" routing) with L = 7 against the
single-device layer over the global batch (``tests/test_parallel_moe.py``'s ``ParallelRun``).

Shape legend: B sequences, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
import unittest

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe.moe import MoE, set_aux_loss_group
from dtensor_moe.moe.balance import collect_aux_losses
from tests._dist import DistTestBase
from tests.test_moe_layer import D, E, close, make_moe, reference_moe

Z_COEFF = 0.3
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
AUX_COEFF = 0.5


def explicit_z_loss(moe: MoE, x: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t (log sum_e exp(w_e . x_t))^2``, one token at a time."""
    terms = []
    for x_D in x.reshape(-1, D):
        logits = torch.stack([w @ x_D for w in moe.router.gate.weight])
        terms.append(torch.log(torch.exp(logits).sum()) ** 2)
    return coeff * torch.stack(terms).mean()


def explicit_global_aux(moe: MoE, x: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * E * sum_e f_e * P_e`` over every token of ``x`` (softmax scores, no bias)."""
    cfg = moe.config
    hits, score_sum, n = torch.zeros(E), torch.zeros(E), 0
    for x_D in x.reshape(-1, D):
        scores = torch.softmax(moe.router.gate.weight @ x_D, dim=0)
        for e in scores.detach().topk(cfg.top_k).indices.tolist():
            hits[e] += 1
        score_sum = score_sum + scores
        n += 1
    f = hits / (cfg.top_k * n)
    P = score_sum / n
    return coeff * E * (f * P).sum()


def layer_step(moe: MoE, x: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    x = x.detach().clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = moe(x)
    (((y * g).sum() + aux.total()) / n).backward()
    return x


def grads(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"x": x.grad}
    out.update({name: p.grad for name, p in moe.named_parameters()})
    return out


@pytest.mark.parametrize("aux_coeff", [0.0, AUX_COEFF])
def test_z_loss_gradient_matches_explicit_reference(aux_coeff):
    """Layer (collected, ``/ 3``) vs the per-token reference plus the explicit z-loss."""
    moe = make_moe(z_loss_coeff=Z_COEFF, aux_loss_coeff=aux_coeff, num_shared_experts=1)
    ref = copy.deepcopy(moe)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(2, 7, D, generator=gen), torch.randn(2, 7, D, generator=gen)
    x_l = layer_step(moe, x, g, 3)
    x_r = x.detach().clone().requires_grad_()
    y_r, aux_r = reference_moe(ref, x_r)
    z_r = explicit_z_loss(ref, x_r, Z_COEFF)
    (((y_r * g).sum() + aux_r + z_r) / 3).backward()
    expected = grads(ref, x_r)
    for name, grad in grads(moe, x_l).items():
        close(grad, expected[name], msg=name)
    close(moe.router.last_z_loss, z_r.detach(), msg="last_z_loss")
    if aux_coeff:
        close(moe.router.last_aux_loss, aux_r.detach(), msg="last_aux_loss")


def test_z_loss_part_of_gate_grad_is_the_explicit_one():
    """With the main loss times 0, the gate gradient is the z-loss gradient alone."""
    moe = make_moe(z_loss_coeff=Z_COEFF)
    ref = copy.deepcopy(moe)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    with collect_aux_losses() as aux:
        y = moe(x)
    ((y * 0).sum() + aux.total()).backward()
    explicit_z_loss(ref, x, Z_COEFF).backward()
    assert moe.router.gate.weight.grad.abs().max() > 1e-4
    close(moe.router.gate.weight.grad, ref.router.gate.weight.grad, msg="gate grad")


def test_z_loss_follows_the_collect_mode():
    """The z-loss alone routes as the aux loss does: no collector in "collect" mode raises."""
    moe = make_moe(z_loss_coeff=Z_COEFF)
    with pytest.raises(ValueError, match=r"outside collect_aux_losses"):
        moe(torch.randn(1, 4, D))
    with collect_aux_losses() as aux:
        moe(torch.randn(1, 4, D))
    assert len(aux.losses) == 1  # one router loss per forward (balance + z summed)
    moe.eval()
    with collect_aux_losses() as aux:
        moe(torch.randn(1, 4, D))
    assert len(aux.losses) == 0


def test_global_batch_aux_matches_explicit_reference():
    moe = make_moe(aux_loss_coeff=AUX_COEFF, aux_loss_type="global_batch", num_shared_experts=1)
    ref = copy.deepcopy(moe)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(3, 5, D, generator=gen), torch.randn(3, 5, D, generator=gen)
    x_l = layer_step(moe, x, g, 1)
    x_r = x.detach().clone().requires_grad_()
    y_r, _ = reference_moe(ref, x_r)  # its sequence-level aux loss is not used
    aux_r = explicit_global_aux(ref, x_r, AUX_COEFF)
    ((y_r * g).sum() + aux_r).backward()
    expected = grads(ref, x_r)
    for name, grad in grads(moe, x_l).items():
        close(grad, expected[name], msg=name)
    close(moe.router.last_aux_loss, aux_r.detach(), msg="last_aux_loss")


def test_config_errors():
    with pytest.raises(ValueError, match=r"z_loss_coeff must be >= 0.*got -0.1"):
        make_moe(z_loss_coeff=-0.1)
    with pytest.raises(ValueError, match=r"aux_loss_type='batch' is not one of"):
        make_moe(aux_loss_type="batch")
    with pytest.raises(ValueError, match=r"no router with aux_loss_type='global_batch'"):
        set_aux_loss_group(make_moe(), None)


# -- 4 ranks ------------------------------------------------------------------------------------


class RouterLossParityTest(DistTestBase):
    def _parity(self, layout: str, global_group: bool, **config) -> None:
        from tests.test_parallel_moe import LAYOUTS, STEPS, Case, ParallelRun
        from tests.test_parallel_moe import close as close_rel

        run = ParallelRun(LAYOUTS[layout], Case(2, 7, 2, 1), self.rank, **config)
        # parallelize_moe sets it (Note [Global batch under parallelize_moe]); nothing else does
        expected_group = dist.group.WORLD if global_group else None
        self.assertIs(run.model.router.aux_loss_group, expected_group, layout)
        for step in range(STEPS):

            def check(actual, expected, what, step=step):
                close_rel(actual, expected, f"{layout} {config} step {step}: {what}")

            run.step(check)
            if run.ref.config.z_loss_coeff > 0:
                z = run.model.router.last_z_loss.clone()
                dist.all_reduce(z, group=run.meshes.dense.get_group("dp"))
                check(z / run.meshes.dp, run.ref.router.last_z_loss, "z loss")
        run.check_params(lambda a, e, w: close_rel(a, e, f"{layout} {config}: {w}"))

    # a repeat: test_global_batch_aux_ep4_and_sp2_ep2 runs the z-loss (with the global-batch
    # balance loss) on ep4 and sp2ep2; DTENSOR_MOE_FULL_MATRIX=1 runs this one too
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_z_loss_ep4_and_sp2_ep2(self):
        for layout in ("ep4", "sp2ep2"):
            self._parity(layout, False, z_loss_coeff=Z_COEFF)

    @with_comms
    def test_z_loss_replicate_routing(self):
        """Expert TP ("replicate": a rank's owned slice) and TP2+EP2 (flat split). CI:
        TP2+EP2; expert TP's z-loss runs in test_global_batch_aux_ep4_and_sp2_ep2 (with the
        global-batch loss), and here too with ``DTENSOR_MOE_FULL_MATRIX=1``."""
        for layout in ("etp2", "tp2ep2") if FULL else ("tp2ep2",):
            self._parity(layout, False, z_loss_coeff=Z_COEFF)

    @with_comms
    def test_global_batch_aux_ep4_and_sp2_ep2(self):
        """Reduced over every rank, vs the single-device loss over the concatenated batch."""
        for layout in ("ep4", "sp2ep2", "etp2"):
            self._parity(layout, True, aux_loss_type="global_batch", z_loss_coeff=Z_COEFF)

    @with_comms
    def test_global_batch_group_needs_a_dense_mesh_over_every_rank(self):
        import dataclasses

        from dtensor_moe import MoE, build_moe_meshes, parallelize_moe
        from tests.test_parallel_moe import Case, make_config

        meshes = build_moe_meshes(dp=2, ep=2, tp=2, device_type="cpu")
        partial = dataclasses.replace(meshes, dense=meshes.expert["ep", "etp"])  # 2 of 4 ranks
        moe = MoE(make_config(Case(2, 7, 2, 1), aux_loss_type="global_batch"))
        with self.assertRaisesRegex(ValueError, r"parallelize_moe: a 'global_batch' balance loss "
                                    r"reduces over .* has 2 of the 4 ranks; call "
                                    r"dtensor_moe\.moe\.set_aux_loss_group"):
            parallelize_moe(moe, partial, sequence_parallel=True)
        own = dist.new_group(list(range(self.world_size)))
        set_aux_loss_group(moe, own)  # a group set beforehand is kept
        parallelize_moe(moe, meshes, sequence_parallel=True)
        self.assertIs(moe.router.aux_loss_group, own)


if __name__ == "__main__":
    run_tests()
