"""Router: scoring, top-k selection, group limits, expert bias, counters and the aux loss.

Shape legend: T tokens, D dim, E experts, K top_k, B sequences, L tokens per sequence.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtensor_moe.moe import (
    MoE,
    MoEConfig,
    TokenChoiceTopKRouter,
    sequence_aux_loss,
    update_expert_bias,
)
from dtensor_moe.moe.balance import collect_aux_losses

D, E = 16, 8


def make_router(**overrides) -> TokenChoiceTopKRouter:
    torch.manual_seed(0)
    fields = dict(dim=D, hidden_dim=32, num_experts=E, top_k=2, init_std=0.5)
    fields.update(overrides)
    return TokenChoiceTopKRouter(MoEConfig(**fields))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm", [False, True])
def test_scores_and_selection(score_func, route_norm):
    router = make_router(score_func=score_func, route_norm=route_norm, route_scale=2.0, top_k=3)
    x_TD = torch.randn(20, D)
    out = router(x_TD)
    logits_TE = x_TD @ router.gate.weight.T
    scores_TE = logits_TE.softmax(-1) if score_func == "softmax" else logits_TE.sigmoid()
    expected_scores, expected_ids = scores_TE.topk(3, dim=-1)
    assert torch.equal(out.topk_ids_TK, expected_ids)
    if route_norm:
        expected_scores = expected_scores / expected_scores.sum(-1, keepdim=True)
        torch.testing.assert_close(out.topk_scores_TK.sum(-1), torch.full((20,), 2.0))
    torch.testing.assert_close(out.topk_scores_TK, 2.0 * expected_scores)
    assert torch.equal(out.counts_E, torch.bincount(expected_ids.flatten(), minlength=E))


@pytest.mark.parametrize("groups,limited", [(4, 1), (4, 2), (2, 1), (8, 3)])
def test_group_limited_routing(groups, limited):
    router = make_router(
        num_expert_groups=groups, num_limited_groups=limited, top_k=min(2, limited * E // groups)
    )
    ids_TK = router(torch.randn(64, D)).topk_ids_TK
    groups_used = [len(set((ids // (E // groups)).tolist())) for ids in ids_TK]
    assert max(groups_used) <= limited


def test_group_limit_equal_to_groups_is_unlimited():
    limited = make_router(num_expert_groups=4, num_limited_groups=4)
    plain = make_router()
    x_TD = torch.randn(32, D)
    assert torch.equal(limited(x_TD).topk_ids_TK, plain(x_TD).topk_ids_TK)


def test_group_scores_use_top_two_experts():
    """Group 0 has one strong expert, group 1 two good ones: top-2 sums pick group 1."""
    router = make_router(num_expert_groups=2, num_limited_groups=1, top_k=2, score_func="sigmoid")
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[:, 0] = torch.tensor([5.0, -5, -5, -5, 2.0, 2.0, -5, -5])
    x_TD = torch.zeros(1, D)
    x_TD[0, 0] = 1.0
    assert sorted(router(x_TD).topk_ids_TK[0].tolist()) == [4, 5]


@pytest.mark.parametrize("per_group", [1, 2, 32])
def test_group_scores_equal_topk_sums_with_ties(per_group):
    """The group scores (max, then amax with the best masked) are the values the plain
    ``topk(2).values.sum(-1)`` rule gives, bit for bit, ties included; the masked experts
    follow."""
    from dtensor_moe.moe.router import _limit_to_top_groups

    groups, limited = 8, 3
    torch.manual_seed(0)
    select_TE = torch.rand(64, groups * per_group)
    select_TE[:8] = 0.5  # every expert tied
    select_TE[8:16, :2] = 0.75  # two tied best experts in group 0 (or groups 0 and 1)
    select_TE[16:24] = torch.randint(0, 3, (8, groups * per_group)) / 4.0  # many ties
    select_TGS = select_TE.view(64, groups, per_group)
    reference_TG = select_TGS.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    top_TL = reference_TG.topk(limited, dim=-1).indices
    keep_TG = torch.zeros(64, groups, dtype=torch.bool).scatter_(1, top_TL, True)
    expected_TE = select_TGS.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(64, -1)
    assert torch.equal(_limit_to_top_groups(select_TE, groups, limited), expected_TE)


def test_expert_bias_changes_selection_not_weights():
    router = make_router(use_expert_bias=True, top_k=1)
    x_TD = torch.randn(16, D)
    scores_TE = (x_TD @ router.gate.weight.T).softmax(-1)
    router.expert_bias[5] = 10.0
    out = router(x_TD)
    assert (out.topk_ids_TK == 5).all()
    torch.testing.assert_close(out.topk_scores_TK[:, 0], scores_TE[:, 5])


def test_counter_accumulates_in_training_only():
    router = make_router()
    x_TD = torch.randn(10, D)
    first = router(x_TD).counts_E
    router(x_TD)
    assert torch.equal(router.tokens_per_expert, 2 * first)
    router.eval()
    router(x_TD)
    assert torch.equal(router.tokens_per_expert, 2 * first)
    assert "tokens_per_expert" not in router.state_dict()


def test_aux_loss_is_coeff_when_perfectly_balanced():
    """Uniform scores and exactly K*L/E hits per expert give f = 1 and P = 1/E: loss = coeff."""
    L, K = 8, 2
    scores_TE = torch.full((2 * L, E), 1.0 / E)
    ids_TK = torch.arange(2 * L * K).remainder(E).view(2 * L, K)
    loss = sequence_aux_loss(scores_TE, ids_TK, num_sequences=2, coeff=0.3)
    torch.testing.assert_close(loss, torch.tensor(0.3))


def test_aux_loss_grad_reaches_router_only():
    config = MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, init_std=0.5)
    base = MoE(config)
    moe = MoE(dataclasses.replace(config, aux_loss_coeff=0.5))
    moe.load_state_dict(base.state_dict())
    x = torch.randn(2, 9, D)
    base(x).sum().backward()
    with collect_aux_losses() as aux:
        y = moe(x)
    (y.sum() + aux.total()).backward()
    assert moe.router.last_aux_loss is not None and moe.router.last_aux_loss.requires_grad is False
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(moe.experts, name).grad, getattr(base.experts, name).grad)
    assert not torch.allclose(moe.router.gate.weight.grad, base.router.gate.weight.grad)
    aux_only = moe.router.gate.weight.grad - base.router.gate.weight.grad
    router = copy.deepcopy(moe.router)
    router.zero_grad()
    router(x.view(-1, D), num_sequences=2).aux_loss.backward()
    scale = float(base.router.gate.weight.grad.abs().max())
    torch.testing.assert_close(aux_only, router.gate.weight.grad, rtol=1e-5, atol=1e-5 * scale)


def test_aux_loss_not_in_eval():
    router = make_router(aux_loss_coeff=0.1)
    router.eval()
    assert router(torch.randn(4, D)).aux_loss is None


def test_bias_update_balances_load():
    """A skewed gate: repeated updates shrink the spread of per-expert loads."""
    router = make_router(use_expert_bias=True, top_k=2)
    with torch.no_grad():
        router.gate.weight[0] += 0.5
    x_TD = torch.randn(512, D)

    def spread() -> int:
        counts = torch.bincount(router(x_TD).topk_ids_TK.flatten(), minlength=E)
        return int(counts.max() - counts.min())

    before = spread()
    with torch.no_grad():
        for _ in range(100):
            router(x_TD)
            update_expert_bias(router, 0.01)
    assert spread() < before / 2
    assert abs(float(router.expert_bias.mean())) < 1e-6


@pytest.mark.parametrize("cast", ["to(bf16)", "bfloat16()", "half()", "double()",
                                  "to(meta, bf16), to_empty"])
def test_expert_bias_keeps_its_dtype_and_values_under_module_casts(cast):
    """Note [Expert bias keeps its dtype]: a module-wide cast changes the parameters, not the
    bias (float32, values unrounded); device moves and ``to_empty`` still apply to it."""
    moe = MoE(MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, use_expert_bias=True))
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E) + 1e-5)  # not bf16-exact
    bias = moe.router.expert_bias.clone()
    param_dtype = {"to(bf16)": torch.bfloat16, "bfloat16()": torch.bfloat16,
                   "half()": torch.float16, "double()": torch.float64,
                   "to(meta, bf16), to_empty": torch.bfloat16}[cast]
    if cast == "to(bf16)":
        moe.to(torch.bfloat16)
    elif cast == "to(meta, bf16), to_empty":
        moe.to("meta", torch.bfloat16)  # a device move and a cast at once
        assert moe.router.expert_bias.is_meta and moe.router.expert_bias.dtype == torch.float32
        moe.to_empty(device="cpu")
    else:
        getattr(moe, cast[:-2])()
    assert {p.dtype for p in moe.parameters()} == {param_dtype}
    assert moe.router.expert_bias.dtype == torch.float32
    assert moe.router.expert_bias.device.type == "cpu"
    assert moe.router.tokens_per_expert.dtype == torch.int64
    if "meta" not in cast:
        assert torch.equal(moe.router.expert_bias, bias)
    moe.router.expert_bias = moe.router.expert_bias.double()  # above float32: kept
    moe.to(torch.float32)
    assert moe.router.expert_bias.dtype == torch.float64


def test_a_bias_below_float32_warns_and_the_next_cast_restores_float32():
    """A bf16 bias that came in by assignment (``load_state_dict(..., assign=True)`` of a
    checkpoint saved from a bf16-cast model): ``update_expert_bias`` warns, and any module cast
    brings it back to float32 (Note [Expert bias keeps its dtype])."""
    moe = MoE(MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, use_expert_bias=True))
    state = {k: v.bfloat16() if v.is_floating_point() else v for k, v in moe.state_dict().items()}
    moe.load_state_dict(state, assign=True)
    assert moe.router.expert_bias.dtype == torch.bfloat16
    moe(torch.randn(1, 8, D, dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match=r"expert_bias is torch.bfloat16, in which steps of "
                      r"rate=0.001 .* may round away"):
        update_expert_bias(moe, 1e-3)
    moe.float()
    assert moe.router.expert_bias.dtype == torch.float32
    assert {p.dtype for p in moe.parameters()} == {torch.float32}
    moe.to("meta")  # a bf16 bias on meta (assigned there), then materialised
    moe.router.expert_bias = moe.router.expert_bias.bfloat16()
    moe.to_empty(device="cpu")
    assert moe.router.expert_bias.dtype == torch.float32
    assert moe.router.expert_bias.device.type == "cpu"


def test_small_bias_updates_survive_a_bf16_model():
    """Why the bias keeps float32: a 1e-4 step near 0.5 rounds away in bf16, which would stall
    aux-loss-free balancing without a sign."""
    half = torch.full((E,), 0.5)
    assert torch.equal(half.bfloat16() + 1e-4, half.bfloat16())  # the failure it avoids
    moe = MoE(MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, use_expert_bias=True))
    with torch.no_grad():
        moe.router.expert_bias.copy_(half)
    moe.to(torch.bfloat16)
    moe(torch.randn(2, 64, D, dtype=torch.bfloat16))  # training mode: counts its tokens
    counts = moe.router.tokens_per_expert.clone()
    update_expert_bias(moe, 1e-4)
    step = moe.router.expert_bias - half
    expected = torch.sign(counts.double().mean() - counts.double())
    expected = (expected - expected.mean()) * 1e-4
    assert step.abs().max() > 0
    torch.testing.assert_close(step.double(), expected, rtol=0, atol=1e-7)


def test_bias_update_all_layers_and_idle_router():
    layers = nn.ModuleList(
        MoE(MoEConfig(dim=D, hidden_dim=32, num_experts=E, top_k=2, use_expert_bias=True))
        for _ in range(2)
    )
    layers[0](torch.randn(1, 5, D))
    update_expert_bias(layers, 0.1)
    assert layers[0].router.expert_bias.abs().sum() > 0
    assert layers[1].router.expert_bias.abs().sum() == 0
    assert all(m.router.tokens_per_expert.sum() == 0 for m in layers)


def test_bias_update_with_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        router = make_router(use_expert_bias=True)
        router(torch.randn(8, D))
        counts = router.tokens_per_expert.clone().double()
        update_expert_bias(router, 0.1, process_group=dist.group.WORLD)
        delta = torch.sign(counts.mean() - counts)
        torch.testing.assert_close(router.expert_bias, ((delta - delta.mean()) * 0.1).float())
    finally:
        dist.destroy_process_group()
