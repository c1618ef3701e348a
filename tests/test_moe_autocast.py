"""Under ``torch.autocast`` the routed experts compute in their weights' dtype and the router
in its ``router_dtype`` on every path: the same dtype and the same bits as without autocast.

Each path is forced, not left to the routing: ``top_k == num_experts`` gives every expert the
same count (what makes ``auto`` pick ``bmm``), and ``compute_path``/``fused_routed_step``
choose the others.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_moe.moe import MoE, MoEConfig
from dtensor_moe.routed import grouped_swiglu

D, H, E = 16, 32, 4

# name -> config fields: every compute path of the routed experts
PATHS = {
    "auto picks bmm (equal counts)": dict(top_k=E),
    "bmm": dict(top_k=E, compute_path="bmm"),
    "grouped_mm, fused routed step": dict(top_k=2, compute_path="grouped_mm"),
    "grouped_mm, plain": dict(top_k=2, compute_path="grouped_mm", fused_routed_step=False),
    "grouped_mm, recompute": dict(top_k=2, compute_path="grouped_mm", recompute_experts=True),
    "loop": dict(top_k=2, compute_path="loop"),
    "loop, recompute": dict(top_k=2, compute_path="loop", recompute_experts=True),
    "padded (plain dispatch)": dict(top_k=2, pad_multiple=4),
    "scores before experts": dict(top_k=2, score_before_experts=True),
    "capacity": dict(top_k=2, capacity_factor=1.0),
}


def _run(moe: MoE, x: torch.Tensor, autocast: bool):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = moe(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_ignores_autocast(path):
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=D, hidden_dim=H, num_experts=E, init_std=0.3, **PATHS[path]))
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(2))
    y, gx, grads = _run(moe, x, autocast=False)
    y_ac, gx_ac, grads_ac = _run(moe, x, autocast=True)
    assert y_ac.dtype == torch.float32
    assert torch.equal(y_ac, y), path
    assert torch.equal(gx_ac, gx), path
    for name in grads:
        assert torch.equal(grads_ac[name], grads[name]), (path, name)


@pytest.mark.parametrize("path", ["grouped_mm", "loop", "bmm"])
def test_grouped_swiglu_ignores_autocast(path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, D, generator=g)
    w1, w3 = torch.randn(E, H, D, generator=g), torch.randn(E, H, D, generator=g)
    w2 = torch.randn(E, D, H, generator=g)
    want = grouped_swiglu(x, w1, w2, w3, [2, 2, 2, 2], path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_swiglu(x, w1, w2, w3, [2, 2, 2, 2], path)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_autocast_still_applies_around_the_layer():
    """The autocast context is back on after the layer (the shared experts, ``nn.Linear``
    modules of the dense kind, follow it, as the rest of the model does)."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=2, num_shared_experts=1))
    lin = torch.nn.Linear(D, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(torch.randn(1, 5, D))
        assert lin(y).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.float32  # fp32 routed output + bf16 shared output
