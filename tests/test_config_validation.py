"""``MoEConfig`` refuses non-finite floats and bad ``router_dtype`` values; the capacity of a
tiny ``capacity_factor`` is the documented ``ceil(f * T * K / E)``, never 0."""

from __future__ import annotations

import math

import pytest
import torch

from dtensor_moe.moe import MoE, MoEConfig
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
