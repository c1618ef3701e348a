"""``MoEConfig`` refuses non-finite floats, non-bool bool fields, bad ``router_dtype`` values
and capacity factors beyond ``E / K``; the capacity of a tiny ``capacity_factor`` is the
documented ``ceil(f * T * K / E)``, never 0. ``update_expert_bias`` refuses rates that would
break the bias; a 0-dim tensor router-loss scale is read when documented, eagerly and compiled."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dtensor_moe.moe import MoE, MoEConfig, set_router_loss_scale, update_expert_bias
from dtensor_moe.moe.capacity import expert_capacity

BASE = dict(dim=16, hidden_dim=32, num_experts=4, top_k=2)
FLOAT_FIELDS = ("route_scale", "aux_loss_coeff", "z_loss_coeff", "init_std")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_non_finite_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{name} must be a finite number, got "
                                         rf"{value!r}"):
        MoEConfig(**BASE, **{name: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_capacity_factor_is_refused(value):
    with pytest.raises(ValueError, match=rf"MoEConfig\.capacity_factor must be a positive finite "
                                         rf"number or None \(dropless\), got {value!r}"):
        MoEConfig(**BASE, capacity_factor=value)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_float_fields_need_numbers(name):
    with pytest.raises(TypeError, match=rf"MoEConfig\.{name} must be a real number, got '1'"):
        MoEConfig(**BASE, **{name: "1"})


def test_finite_values_still_accepted():
    cfg = MoEConfig(**BASE, route_scale=2.5, aux_loss_coeff=1e-3, z_loss_coeff=1e-4,
                    init_std=1, capacity_factor=1.25)
    assert (cfg.route_scale, cfg.init_std, cfg.capacity_factor) == (2.5, 1, 1.25)


@pytest.mark.parametrize(
    "value,want",
    [("float32", torch.float32), ("torch.bfloat16", torch.bfloat16), (torch.float64,
     torch.float64), (None, None)],
)
def test_router_dtype_takes_a_dtype_or_its_name(value, want):
    assert MoEConfig(**BASE, router_dtype=value).router_dtype is want


@pytest.mark.parametrize("value", ["fp32", "int8", torch.int32, torch.float8_e4m3fn, 32])
def test_router_dtype_refuses_others(value):
    with pytest.raises(ValueError, match=rf"router_dtype must be None or one of float16, "
                                         rf"bfloat16, float32, float64 .*got {value!r}"):
        MoEConfig(**BASE, router_dtype=value)


@pytest.mark.parametrize(
    "tokens,factor,want",
    [
        (6, 1e-12, 1),  # 1e-12 * 6 * 2 / 4 > 0: ceil gives 1 (a rounding gave 0 before)
        (1, 1e-300, 1),
        (0, 1.25, 0),  # no tokens, no capacity
        (8, 1.0, 4),  # 1.0 * 8 * 2 / 4 = 4 exactly: not 5 from a float error
        (10, 1.25, 7),  # 6.25 -> 7
        (12, 1.1, 7),  # 6.6 -> 7
        (2000, 1.1, 1100),  # 1100.0000000000002 in floats: the intended 1100
        (4096, 1.25, 2560),
    ],
)
def test_capacity_is_the_documented_ceiling(tokens, factor, want):
    assert expert_capacity(tokens, top_k=2, num_experts=4, factor=factor) == want


def test_tiny_capacity_factor_keeps_a_pair_per_expert():
    """The layer with ``capacity_factor=1e-12`` keeps one pair per expert that gets any."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**BASE, capacity_factor=1e-12, init_std=0.5)).train()
    moe(torch.randn(1, 6, 16))
    kept = moe.router.tokens_per_expert - moe.router.dropped_per_expert
    assert torch.equal(kept, (moe.router.tokens_per_expert > 0).long()), (
        moe.router.tokens_per_expert, moe.router.dropped_per_expert)


BOOL_FIELDS = ("route_norm", "score_before_experts", "use_expert_bias", "shared_expert_gate",
               "recompute_experts", "fused_routed_step", "pad_to_capacity",
               "force_balanced_routing")


@pytest.mark.parametrize("value", [1, 0, "no", None, 1.0])
@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_bool_fields_need_bools(name, value):
    with pytest.raises(TypeError, match=rf"MoEConfig\.{name} must be a bool, got "
                                        rf"{re.escape(repr(value))}; pass True or False"):
        MoEConfig(**BASE, **{name: value})


def test_bool_fields_take_bools():
    cfg = MoEConfig(**BASE, route_norm=False, use_expert_bias=True, score_before_experts=True,
                    num_shared_experts=1, shared_expert_gate=True)
    assert (cfg.route_norm, cfg.use_expert_bias, cfg.score_before_experts) == (False, True, True)


@pytest.mark.parametrize("factor", [1e308, 4.5])
def test_capacity_factor_beyond_num_experts_is_refused(factor):
    """Beyond ``E`` the capacity exceeds the batch's pairs; ``1e308`` overflowed it."""
    with pytest.raises(ValueError, match=rf"MoEConfig\.capacity_factor={re.escape(repr(factor))} "
                                         r"exceeds num_experts=4, .* num_experts / top_k = 2 "
                                         r"already gives .* use a factor <= 2, or None for "
                                         r"dropless routing"):
        MoEConfig(**BASE, capacity_factor=factor)


@pytest.mark.parametrize("factor", [2.0, 4])
def test_capacity_factor_up_to_num_experts_keeps_every_pair(factor):
    moe = MoE(MoEConfig(**BASE, capacity_factor=factor, init_std=0.5)).train()
    moe(torch.randn(2, 5, 16))
    assert moe.router.dropped_per_expert.sum().item() == 0
    assert expert_capacity(10, top_k=2, num_experts=4, factor=factor) == 5 * factor  # C >= T


def _biased_moe() -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**BASE, use_expert_bias=True, init_std=0.5)).train()
    moe(torch.randn(2, 5, 16))
    return moe


@pytest.mark.parametrize(
    "rate,error,message",
    [
        (math.inf, ValueError, r"needs a positive rate, got inf"),
        (math.nan, ValueError, r"needs a positive rate, got nan"),
        (-1e-3, ValueError, r"needs a positive rate, got -0\.001"),
        (0, ValueError, r"needs a positive rate, got 0"),
        (True, TypeError, r"rate must be a real number, got True"),
        ("1e-3", TypeError, r"rate must be a real number, got '1e-3'"),
        (1e308, ValueError, r"rate=1e\+308 could make the expert bias of 'router' non-finite "
                            r"\(a step moves an entry by up to 2 \* rate; torch\.float32 holds "
                            r"values up to 3\.40282e\+38\)"),
        (1e39, ValueError, r"rate=1e\+39 could make the expert bias of 'router' non-finite"),
    ],
)
def test_update_expert_bias_refuses_rates_that_break_the_bias(rate, error, message):
    """``inf`` or ``1e308`` gave ``[inf, -inf, -inf, inf]``: two experts dead for good."""
    moe = _biased_moe()
    counts = moe.router.tokens_per_expert.clone()
    with pytest.raises(error, match=message):
        update_expert_bias(moe, rate)
    assert torch.equal(moe.router.expert_bias, torch.zeros(4))  # nothing changed
    assert torch.equal(moe.router.tokens_per_expert, counts)


def test_update_expert_bias_takes_a_large_finite_step():
    moe = _biased_moe()
    update_expert_bias(moe, 1e30)
    assert torch.isfinite(moe.router.expert_bias).all() and moe.router.expert_bias.abs().max() > 0


def _gate_grad(run: torch.nn.Module, moe: MoE, scale: torch.Tensor, x: torch.Tensor,
               at_forward: float, at_backward: float) -> torch.Tensor:
    """The gate's grad with an attached balance loss whose 0-dim tensor ``scale`` holds
    ``at_forward`` during the forward of ``run`` and ``at_backward`` (set in place) during the
    backward."""
    moe.zero_grad()
    scale.fill_(at_forward)
    y = run(x)
    scale.fill_(at_backward)
    y.sum().backward()
    return moe.router.gate.weight.grad.clone()


def test_tensor_scale_read_at_backward_eagerly_at_forward_compiled():
    """Note [Attached router losses under loss scaling]: the documented readings of a tensor
    scale. Set before the forward, eager and compiled agree."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**BASE, aux_loss_coeff=0.5, aux_loss_mode="attach")).train()
    scale = torch.tensor(1.0)
    set_router_loss_scale(moe, scale)
    x = torch.randn(2, 3, 16)
    with_1, with_3 = (_gate_grad(moe, moe, scale, x, s, s) for s in (1.0, 3.0))
    assert not torch.allclose(with_1, with_3)
    torch.testing.assert_close(_gate_grad(moe, moe, scale, x, 1.0, 3.0), with_3)  # at backward
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager")
    torch.testing.assert_close(_gate_grad(compiled, moe, scale, x, 1.0, 3.0), with_1)  # forward
    torch.testing.assert_close(_gate_grad(compiled, moe, scale, x, 3.0, 3.0), with_3)
