"""Every user mistake in the MoE layer raises a clear ValueError (or TypeError)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor_moe.moe import MoE, MoEConfig, update_expert_bias
from dtensor_moe.routed import LocalExchange, grouped_swiglu

BASE = dict(dim=16, hidden_dim=32, num_experts=4, top_k=2)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(top_k=5), r"top_k=5 exceeds num_experts=4"),
        (dict(top_k=0), r"top_k must be a positive int, got 0"),
        (dict(dim=0), r"dim must be a positive int, got 0"),
        (dict(hidden_dim=2.5), r"hidden_dim must be a positive int, got 2.5"),
        (dict(num_experts=True), r"num_experts must be a positive int, got True"),
        (dict(pad_multiple=0), r"pad_multiple must be a positive int"),
        (dict(score_func="relu"), r"score_func='relu' is not one of"),
        (dict(compute_path="cuda"), r"compute_path='cuda' is not one of"),
        (dict(route_scale=0.0), r"route_scale must be positive, got 0.0"),
        (dict(aux_loss_coeff=-1.0), r"aux_loss_coeff must be >= 0"),
        (dict(num_shared_experts=-1), r"num_shared_experts must be >= 0, got -1"),
        (dict(shared_hidden_dim=0), r"shared_hidden_dim must be positive or None, got 0"),
        (
            dict(shared_expert_gate=True),
            r"shared_expert_gate=True needs shared experts; set num_shared_experts >= 1",
        ),
        (dict(init_std=0.0), r"init_std must be positive"),
        (dict(num_expert_groups=2), r"needs both .*num_expert_groups=2, num_limited_groups=None"),
        (
            dict(num_expert_groups=3, num_limited_groups=1),
            r"num_experts=4 is not divisible by num_expert_groups=3",
        ),
        (
            dict(num_expert_groups=2, num_limited_groups=3),
            r"num_limited_groups=3 must be in \[1, num_expert_groups=2\]",
        ),
        (
            dict(num_expert_groups=4, num_limited_groups=1),
            r"top_k=2 exceeds the 1 experts reachable",
        ),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **overrides})


def test_moe_needs_config():
    with pytest.raises(TypeError, match="MoE expects a MoEConfig, got dict"):
        MoE(BASE)


@pytest.mark.parametrize(
    "x,match",
    [
        (torch.randn(2, 3, 8), r"x of shape \(batch, seq_len, dim=16\), got \(2, 3, 8\)"),
        (torch.randn(6, 16), r"got \(6, 16\)"),
        (torch.ones(1, 2, 16, dtype=torch.int64), r"floating-point input, got dtype=torch.int64"),
    ],
)
def test_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        MoE(MoEConfig(**BASE))(x)


def test_router_errors():
    router = MoE(MoEConfig(**BASE)).router
    with pytest.raises(ValueError, match=r"x_TD of shape \(tokens, dim=16\), got \(3, 8\)"):
        router(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"got 5 tokens, not divisible into num_sequences=2"):
        router(torch.randn(5, 16), num_sequences=2)


def test_dispatcher_errors():
    with pytest.raises(ValueError, match=r"pad_multiple >= 1, got num_experts=4, pad_multiple=0"):
        LocalExchange(num_experts=4, pad_multiple=0)
    d = LocalExchange(num_experts=4)
    x, s, ids, counts = (
        torch.randn(3, 16),
        torch.rand(3, 2),
        torch.zeros(3, 2, dtype=torch.long),
        torch.zeros(4),
    )
    with pytest.raises(ValueError, match=r"same T, got \(3, 16\) and \(2, 2\)"):
        d.dispatch(x, s[:2], ids[:2], counts)
    with pytest.raises(ValueError, match=r"topk_scores_TK \(3, 1\) and topk_ids_TK \(3, 2\)"):
        d.dispatch(x, s[:, :1], ids, counts)
    with pytest.raises(ValueError, match=r"counts_E has shape \(5,\), expected \(4,\)"):
        d.dispatch(x, s, ids, torch.zeros(5))


def test_grouped_swiglu_errors():
    x = torch.randn(6, 16)
    w1, w2, w3 = torch.randn(4, 32, 16), torch.randn(4, 16, 32), torch.randn(4, 32, 16)
    with pytest.raises(ValueError, match="counts_e has 3 entries but the weights hold 4 experts"):
        grouped_swiglu(x, w1, w2, w3, [2, 2, 2])
    with pytest.raises(ValueError, match="counts_e sums to 5 but x_RD has 6 rows"):
        grouped_swiglu(x, w1, w2, w3, [2, 2, 1, 0])
    with pytest.raises(
        ValueError, match=r"compute_path='bmm' needs the same token count .*\[3, 1, 1, 1\]"
    ):
        grouped_swiglu(x, w1, w2, w3, [3, 1, 1, 1], "bmm")
    with pytest.raises(ValueError, match=r"grouped_mm' needs dtype .* got dtype=torch.float64"):
        grouped_swiglu(
            x.double(), w1.double(), w2.double(), w3.double(), [3, 1, 1, 1], "grouped_mm"
        )
    with pytest.raises(ValueError, match=r"unknown compute path 'fast'"):
        grouped_swiglu(x, w1, w2, w3, [3, 1, 1, 1], "fast")


def test_update_expert_bias_errors():
    with pytest.raises(
        ValueError, match=r"no router with an expert bias in MoE; .*use_expert_bias=True"
    ):
        update_expert_bias(MoE(MoEConfig(**BASE)), 0.1)
    with pytest.raises(ValueError, match=r"no router with an expert bias in Linear"):
        update_expert_bias(nn.Linear(2, 2), 0.1)
    with pytest.raises(ValueError, match="positive rate, got 0"):
        update_expert_bias(MoE(MoEConfig(**BASE, use_expert_bias=True)), 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_input_dtype_must_match_the_expert_weights(dtype):
    """A clear error instead of a matmul's dtype message deep in the experts, with and without
    autocast (which does not apply to the routed experts). Seeded: the routing, and with it
    the compute path, does not depend on the tests run before (every path is covered under
    autocast in tests/test_moe_autocast.py)."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2))
    x = torch.randn(2, 3, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    match = rf"experts got input of dtype={dtype} but their weights are torch.float32"
    with pytest.raises(ValueError, match=match):
        moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=match):
        moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a float32 input runs, experts in fp32
        assert moe(x.float()).dtype == torch.float32

