"""Router losses under loss scaling and pipeline schedules (Note [Attached router losses under
loss scaling] in ``moe/router.py``, Note [Router losses under pipeline schedules] in
``moe/balance.py``).

One process: ``set_router_loss_scale`` gives the attached router losses the weight of a scaled
loss, against the per-token reference of ``tests/test_moe_layer.py`` with the losses added to
the loss (``tests/test_aux_loss.py``'s helpers). 4 gloo ranks, pp2 x dp2 with EP2 in each stage
(``tests/test_pipeline_schedule.py``'s model and reference): 3 steps of a fused AdamW with the
sequence-level balance loss and the z-loss under ``Schedule1F1B`` with a ``GradScaler``, the
global-batch balance loss under ``ScheduleZBVZeroBubble`` with a ``loss_fn`` that divides by the
number of micro-batches (``scale_grads=False``), both factors at once under
``ScheduleInterleaved1F1B``, the global-batch loss with a ``GradScaler`` under ``ScheduleGPipe``
and the sequence loss with a dividing ``loss_fn`` under ``ScheduleDualPipeV``: losses, every param gradient, the params after 3 steps and the
routers' counters equal one process's (1e-5 relative, fp32). And the collect route under a
schedule: an error, never a lost loss.

Shape legend: D dim.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms
from torch.utils.checkpoint import checkpoint

from dtensor_moe import MoE, collect_aux_losses
from dtensor_moe.moe import set_router_loss_scale
from tests._dist import DistTestBase
from tests.test_aux_loss import (
    SCALE,
    assert_same_grads,
    data,
    forward,
    grads,
    make,
    reference,
)
from tests.test_pipeline_schedule import N_MICRO, b, build_pipeline, check_training, tokens

# -- one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [SCALE, 1 / 4, 0.0])
def test_scale_gives_the_attached_losses_the_weight_of_a_scaled_loss(factor):
    """``(factor * L).backward()`` with the scale set to ``factor``: the grads of
    ``factor * (L + aux)``, gate, experts and input."""
    moe = make("attach")
    ref = copy.deepcopy(moe)
    set_router_loss_scale(moe, factor)
    X, G = data(30)
    x = X.clone().requires_grad_()
    ((moe(x) * G).sum() * factor).backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) * factor).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), f"attach, scale {factor}")


def test_tensor_scale_is_read_at_backward():
    """A tensor scale counts with its value when backward runs (a GradScaler's scale changes
    between steps, in place); the caller's tensor is never handed to autograd."""
    moe = make("attach")
    ref = copy.deepcopy(moe)
    scale = torch.tensor(1.0)
    set_router_loss_scale(moe, scale)
    X, G = data(31)
    x = X.clone().requires_grad_()
    y = moe(x)
    scale.fill_(8.0)  # after the forward, before the backward
    ((y * G).sum() * 8.0).backward()
    assert float(scale) == 8.0
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) * 8.0).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "tensor scale")


def test_collected_losses_ignore_the_scale():
    """A collector takes the loss in either mode: it is part of the user's loss, which carries
    the factor itself."""
    moe = make("attach")
    ref = copy.deepcopy(moe)
    set_router_loss_scale(moe, 5.0)
    X, G = data(32)
    x, y, aux = forward(moe, X)
    (((y * G).sum() + aux) * 3.0).backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) * 3.0).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "collected, scale set")


def test_reentrant_recompute_attaches_with_the_scale():
    """Collect mode under reentrant checkpointing: the first forward runs without grad, the
    recompute attaches the loss, with the router's scale."""
    moe = make()
    ref = copy.deepcopy(moe)
    set_router_loss_scale(moe, SCALE)
    X, G = data(33)
    x = X.clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = checkpoint(moe, x, use_reentrant=True)
    assert len(aux) == 0
    ((y * G).sum() * SCALE).backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) * SCALE).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "reentrant recompute, scaled")


def test_set_router_loss_scale_checks_the_scale():
    moe = make("attach")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"scale={bad} must be finite and >= 0"):
            set_router_loss_scale(moe, bad)
    with pytest.raises(TypeError, match=r"must be 0-dim and floating, got shape \(2,\)"):
        set_router_loss_scale(moe, torch.ones(2))
    with pytest.raises(TypeError, match=r"dtype torch.int64"):
        set_router_loss_scale(moe, torch.tensor(2))
    for bad in ("2", True, None):
        with pytest.raises(TypeError, match=r"a float or a 0-dim tensor, got"):
            set_router_loss_scale(moe, bad)
    assert moe.router.aux_loss_scale == 1.0  # nothing set by a refused call
    dense = nn.Linear(2, 2)  # a pipeline stage without MoE layers: nothing to set
    set_router_loss_scale([dense, moe], 2)
    assert moe.router.aux_loss_scale == 2.0 and isinstance(moe.router.aux_loss_scale, float)


# -- 4 ranks: pp2 x dp2, EP2 in each stage -------------------------------------------------------


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=16.0)


class PipelineRouterLossTest(DistTestBase):
    @with_comms
    def test_1f1b_fsdp_grad_scaler_sequence_aux_loss(self):
        check_training(self, Schedule1F1B, "single", fsdp=True, aux="sequence", scaler=_scaler())

    @with_comms
    def test_zero_bubble_v_global_batch_aux_loss_loss_divided(self):
        check_training(self, ScheduleZBVZeroBubble, "v", aux="global_batch", divide=True)

    @with_comms
    def test_interleaved_1f1b_grad_scaler_and_loss_divided(self):
        check_training(self, ScheduleInterleaved1F1B, "loop", aux="sequence", scaler=_scaler(),
                       divide=True)

    @with_comms
    def test_gpipe_global_batch_aux_loss_grad_scaler(self):
        check_training(self, ScheduleGPipe, "single", aux="global_batch", scaler=_scaler())

    @with_comms
    def test_dualpipe_v_sequence_aux_loss_loss_divided(self):
        check_training(self, ScheduleDualPipeV, "v", aux="sequence", divide=True)

    @with_comms
    def test_collect_route_raises_in_a_stage(self):
        """In a stage, a collect-mode MoE layer with router losses raises in its first forward,
        before the stage sends anything. No collector: the loss has nowhere to go; a collector
        around ``schedule.step()``: it would never be used. (A first step on the attach route
        lets torch warm the stages' p2p up, so that the first stage can then step alone.)"""
        pipe = build_pipeline(self, Schedule1F1B, "single", aux="sequence")
        local = tokens(2)[self.rank % 2 * N_MICRO * b :][: N_MICRO * b]
        pipe.step(local, [])
        for module in pipe.modules:
            for moe in module.modules():
                if isinstance(moe, MoE):
                    moe.config = dataclasses.replace(moe.config, aux_loss_mode="collect")
        if pipe.meshes.pp_rank != 0:
            return
        for around, match in ((False, "where nothing collects"),
                              (True, "opened outside the stage")):
            with self.assertRaises(RuntimeError) as caught:  # the stage's wrapper of the error
                if around:
                    with collect_aux_losses() as collector:
                        pipe.step(local, [])
                else:
                    pipe.step(local, [])
            cause = caught.exception.__cause__
            self.assertIsInstance(cause, ValueError)
            self.assertRegex(str(cause), match)
            self.assertIn("aux_loss_mode='attach'", str(cause))
            self.assertIn("set_router_loss_scale", str(cause))
        self.assertEqual(len(collector), 0)

if __name__ == "__main__":
    run_tests()
