"""``MoEConfig.router_dtype``: the router's logits and scores in that dtype whatever the
parameters' dtype, with the gradient reaching the weight in its own dtype. The references
compute the routing by hand (``F.linear`` in the expected dtype, softmax/sigmoid, top-k)."""

# ruff: noqa: N806

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtensor_moe.moe import MoE, MoEConfig

D, E = 16, 8
X = torch.randn(64, D, generator=torch.Generator().manual_seed(0))


def _moe(**fields) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, init_std=0.5, **fields))


def _logits_dtype(moe: MoE, x: torch.Tensor) -> torch.dtype:
    seen = []
    handle = moe.router.gate.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with torch.no_grad():
        moe.router(x)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize(
    "param_dtype,router_dtype,want",
    [
        (torch.float32, None, torch.float32),
        (torch.bfloat16, None, torch.bfloat16),  # the default: the gate weight's dtype
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, "bfloat16", torch.bfloat16),
        (torch.float64, torch.float32, torch.float32),
    ],
)
def test_logits_in_the_router_dtype(param_dtype, router_dtype, want):
    moe = _moe(router_dtype=router_dtype).to(param_dtype)
    assert _logits_dtype(moe, X.to(param_dtype)) == want


def test_autocast_does_not_reach_the_router():
    moe = _moe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _logits_dtype(moe, X) == torch.float32
        assert _logits_dtype(_moe(router_dtype=torch.float64).double(), X.double()) == torch.float64


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_float32_routing_of_a_bf16_model_and_its_gradient(score_func):
    extra = {}
    if score_func == "sigmoid":
        extra = dict(use_expert_bias=True, num_expert_groups=4, num_limited_groups=2,
                     route_norm=True, route_scale=2.5)
    moe = _moe(router_dtype=torch.float32, score_func=score_func, **extra).to(torch.bfloat16)
    router = moe.router
    if router.expert_bias is not None:
        with torch.no_grad():
            router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    x = X.bfloat16()
    routing = router(x)
    g = torch.randn(routing.topk_scores_TK.shape, generator=torch.Generator().manual_seed(1))
    (routing.topk_scores_TK.float() * g).sum().backward()

    # the reference, by hand in float32 from the bf16 weight
    w = router.gate.weight.detach().float().requires_grad_()
    logits = F.linear(x.float(), w)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    choice = scores.detach()
    if router.expert_bias is not None:
        choice = choice + router.expert_bias
        groups = choice.view(-1, 4, E // 4).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(2, -1).indices, 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(E // 4, 1), float("-inf"))
    ids = choice.topk(2, -1).indices
    assert torch.equal(routing.topk_ids_TK, ids)
    weights = scores.gather(1, ids)
    if score_func == "sigmoid":
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5
    torch.testing.assert_close(routing.topk_scores_TK.float(), weights.bfloat16().float())
    (weights.bfloat16().float() * g).sum().backward()
    assert router.gate.weight.grad.dtype == torch.bfloat16  # cast inside autograd
    torch.testing.assert_close(router.gate.weight.grad, w.grad.bfloat16(), rtol=1e-2, atol=1e-3)


def test_bf16_routing_differs_from_float32_routing():
    """What ``router_dtype`` changes: on enough tokens, bf16 logits pick other experts."""
    x = torch.randn(4096, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    plain = _moe().to(torch.bfloat16)
    fp32 = _moe(router_dtype=torch.float32).to(torch.bfloat16)
    with torch.no_grad():
        a, b = plain.router(x).topk_ids_TK, fp32.router(x).topk_ids_TK
    assert not torch.equal(a.sort(-1).values, b.sort(-1).values)


def test_router_dtype_under_compile():
    moe = _moe(router_dtype=torch.float32).to(torch.bfloat16).eval()
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2)).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        eager = moe(x)
        compiled = torch.compile(moe, backend="aot_eager")(x)
    assert torch.equal(compiled, eager)
