"""The MoE layer against a naive per-token reference: outputs, input grad, every param grad.

Shape legend: B sequences, L tokens per sequence, T = B * L, D dim, E experts, K top_k.
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtensor_moe.moe import MoE, MoEConfig, update_expert_bias
from dtensor_moe.moe.balance import collect_aux_losses
from dtensor_moe.routed.experts import compute

D, H, E = 16, 32, 4
TOL = 1e-5


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """Within 1e-5 relative, elementwise or to the tensor's largest magnitude (fp32 rounding
    of elements near zero)."""
    atol = TOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=atol, msg=msg)


def make_moe(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    fields = dict(dim=D, hidden_dim=H, num_experts=E, top_k=2, init_std=0.3)
    fields.update(overrides)
    return MoE(MoEConfig(**fields))


def _swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _reference_routing(moe: MoE, x_D: torch.Tensor):
    """Scores of one token and its selected expert ids, written independently of the layer."""
    cfg, router = moe.config, moe.router
    logits = (router.gate.weight @ x_D).float()
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    select = scores.detach().clone()
    if router.expert_bias is not None:
        select = select + router.expert_bias
    if cfg.num_expert_groups is not None:
        per_group = E // cfg.num_expert_groups
        grouped = select.view(cfg.num_expert_groups, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        keep = group_score.topk(cfg.num_limited_groups).indices
        mask = torch.full_like(grouped, float("-inf"))
        mask[keep] = 0
        select = (grouped + mask).view(-1)
    ids = select.topk(cfg.top_k).indices
    return scores, ids


def reference_moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over tokens: sum_k w_k * expert_k(x) (+ each shared expert); also the aux loss."""
    cfg = moe.config
    B, L, _ = x.shape
    ex, sh = moe.experts, moe.shared_experts
    outs, all_scores, all_ids = [], [], []
    for x_D in x.reshape(B * L, D):
        scores, ids = _reference_routing(moe, x_D)
        w = scores[ids]
        if cfg.route_norm:
            w = w / w.sum()
        w = w * cfg.route_scale
        y_D = x_D.new_zeros(D)
        for w_k, i in zip(w, ids.tolist()):
            if cfg.score_before_experts:
                y_D = y_D + _swiglu(w_k * x_D, ex.w1[i], ex.w2[i], ex.w3[i])
            else:
                y_D = y_D + w_k * _swiglu(x_D, ex.w1[i], ex.w2[i], ex.w3[i])
        if sh is not None:
            h = cfg.shared_hidden_total // cfg.num_shared_experts
            shared_D = x_D.new_zeros(D)
            for s in range(cfg.num_shared_experts):
                rows = slice(s * h, (s + 1) * h)
                shared_D = shared_D + _swiglu(
                    x_D, sh.w1.weight[rows], sh.w2.weight[:, rows], sh.w3.weight[rows]
                )
            if cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(x . g) scales the shared output
                shared_D = torch.sigmoid(sh.gate.weight[0] @ x_D) * shared_D
            y_D = y_D + shared_D
        outs.append(y_D)
        all_scores.append(scores)
        all_ids.append(ids)
    y = torch.stack(outs).view(B, L, D) if outs else x * 0
    return y, _reference_aux_loss(cfg, all_scores, all_ids, B, L)


def _reference_aux_loss(cfg, all_scores, all_ids, B, L) -> torch.Tensor:
    if cfg.aux_loss_coeff == 0 or L == 0:
        return torch.zeros(())
    total = torch.zeros(())
    for b in range(B):
        scores = torch.stack(all_scores[b * L : (b + 1) * L])
        if cfg.score_func == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        hits = torch.zeros(E)
        for ids in all_ids[b * L : (b + 1) * L]:
            hits[ids] += 1
        f = hits * E / (cfg.top_k * L)
        total = total + (f * scores.mean(0)).sum()
    return cfg.aux_loss_coeff * total / B


def assert_matches_reference(moe: MoE, x: torch.Tensor, seed: int = 1) -> None:
    ref = copy.deepcopy(moe)
    x_ref = x.detach().clone().requires_grad_()
    x = x.detach().clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = moe(x)
    y_ref, aux_ref = reference_moe(ref, x_ref)
    assert y.shape == x.shape and y.dtype == x.dtype
    close(y, y_ref)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    ((y * g).sum() + aux.total()).backward()
    ((y_ref * g).sum() + aux_ref).backward()
    close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters()):
        expected = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        assert p.grad is not None, name
        close(p.grad, expected, msg=name)


GRID = list(itertools.product([1, 3], [1, 7, 64], [1, 2, E], ["softmax", "sigmoid"], [0, 2]))


@pytest.mark.parametrize("B,L,top_k,score_func,num_shared", GRID)
def test_matches_reference(B, L, top_k, score_func, num_shared):
    moe = make_moe(
        top_k=top_k, score_func=score_func, num_shared_experts=num_shared, shared_hidden_dim=8
    )
    assert_matches_reference(moe, torch.randn(B, L, D))


@pytest.mark.parametrize("path", ["loop", "grouped_mm"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_forced_paths_match_reference(path, top_k):
    assert_matches_reference(make_moe(top_k=top_k, compute_path=path), torch.randn(2, 9, D))


def test_bmm_path_matches_reference():
    """top_k == E gives every expert all T tokens, the equal-count case."""
    assert_matches_reference(make_moe(top_k=E, compute_path="bmm"), torch.randn(2, 5, D))


@pytest.mark.parametrize("hidden", [8, 2 * D], ids=["H<D", "H>D"])
def test_combine_weights_on_the_narrower_side(hidden):
    """The combine weights scale the SwiGLU products (``H <= D``) or the expert outputs: both
    sides match the reference on every path (``top_k == E``: equal counts, so ``bmm`` runs), and
    the default (fused) path gives the plain path's output bits."""
    x = torch.randn(2, 5, D)
    for options in ({}, dict(fused_routed_step=False), dict(compute_path="loop"),
                    dict(compute_path="bmm"), dict(recompute_experts=True)):
        assert_matches_reference(make_moe(hidden_dim=hidden, top_k=E, **options), x)
    fused, plain = make_moe(hidden_dim=hidden), make_moe(hidden_dim=hidden, fused_routed_step=False)
    assert torch.equal(fused(x), plain(x))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(route_norm=True, route_scale=2.5),
        dict(score_func="sigmoid", route_norm=True, top_k=3),
        dict(score_before_experts=True),
        dict(score_before_experts=True, pad_multiple=4, compute_path="loop"),
        dict(pad_multiple=8),
        dict(pad_multiple=3, top_k=1, compute_path="loop"),
        dict(num_expert_groups=2, num_limited_groups=1),
        dict(num_expert_groups=4, num_limited_groups=2, score_func="sigmoid", route_norm=True),
        dict(use_expert_bias=True),
        dict(aux_loss_coeff=0.1),
        dict(aux_loss_coeff=0.1, score_func="sigmoid", num_shared_experts=1),
        dict(num_shared_experts=2, shared_hidden_dim=8, shared_expert_gate=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_options_match_reference(overrides):
    moe = make_moe(**overrides)
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    assert_matches_reference(moe, torch.randn(3, 7, D))


def test_experts_with_zero_tokens():
    """A gate that sends every token to experts 0 and 1 leaves experts 2 and 3 empty."""
    moe = make_moe(num_shared_experts=1)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:2] = 1.0
    x = torch.rand(2, 7, D) + 0.5
    assert_matches_reference(moe, x)
    assert moe.experts.w1.grad[2:].abs().max() == 0
    assert moe.router.tokens_per_expert[2:].sum() == 0


@pytest.mark.parametrize("path", ["auto", "loop", "grouped_mm", "bmm"])
@pytest.mark.parametrize("shape", [(0, 5, D), (2, 0, D)])
def test_zero_tokens(path, shape):
    moe = make_moe(compute_path=path, num_shared_experts=1, aux_loss_coeff=0.1, pad_multiple=4)
    x = torch.randn(shape, requires_grad=True)
    with collect_aux_losses() as aux:
        y = moe(x)
    assert y.shape == shape
    (y.sum() + aux.total()).backward()
    assert x.grad.shape == shape
    for name, p in moe.named_parameters():
        assert p.grad is None or p.grad.abs().max() == 0, name


def test_bf16_close_to_fp32():
    """bf16 runs and stays within 3e-2 (relative to the output scale) of fp32."""
    moe = make_moe(num_shared_experts=1)
    moe_bf16 = copy.deepcopy(moe).to(torch.bfloat16)
    x = torch.randn(3, 16, D)
    y = moe(x)
    y_bf16 = moe_bf16(x.to(torch.bfloat16))
    assert y_bf16.dtype == torch.bfloat16
    scale = float(y.detach().abs().max())
    torch.testing.assert_close(y_bf16.float(), y, rtol=0, atol=3e-2 * scale)
    y_bf16.float().sum().backward()
    y.sum().backward()
    for p, p16 in zip(moe.parameters(), moe_bf16.parameters()):
        torch.testing.assert_close(
            p16.grad.float(), p.grad, rtol=0, atol=3e-2 * float(p.grad.abs().max())
        )


def test_sum_backward_through_grouped_mm_path():
    """y.sum() gives an expanded grad, which torch's grouped_mm backward rejects on CPU."""
    moe = make_moe(compute_path="grouped_mm")
    x = torch.randn(2, 7, D, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad is not None and moe.experts.w2.grad is not None


def _second_order(moe: MoE, fn, x: torch.Tensor, squared: bool) -> torch.Tensor:
    """A gradient penalty: ``||d loss / d x||^2`` backpropagated with ``create_graph=True``.
    ``squared``: the loss is ``sum(y^2)`` (its upstream gradient requires grad); otherwise
    ``sum(y * W)`` with a fixed ``W`` (it does not: the case once_differentiable gets wrong)."""
    y = fn(moe, x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    loss = y.pow(2).sum() if squared else (y * w).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (g.pow(2).sum() + 0.5 * y.sum()).backward()
    return g.detach()


@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(num_shared_experts=1, score_func="sigmoid", route_norm=True),
        dict(compute_path="loop", top_k=3),
        dict(pad_multiple=4),
        dict(score_before_experts=True),
    ],
    ids=["grouped_mm", "shared_sigmoid", "loop", "padded", "score_before"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["default", "plain"])
def test_double_backward_matches_reference(overrides, squared, fused):
    """Note [Double backward] in dtensor_moe/routed/layouts.py: on the default path and with
    ``fused_routed_step=False``, a gradient penalty's gradients (input and every parameter)
    equal the per-token reference's, which is plain autograd."""
    moe = make_moe(fused_routed_step=fused, **overrides)
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 7, D)
    x_moe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = _second_order(moe, lambda m, x: m(x), x_moe, squared)
    g_ref = _second_order(ref, lambda m, x: reference_moe(m, x)[0], x_ref, squared)
    close(g, g_ref, "first-order input gradient")
    close(x_moe.grad, x_ref.grad, "x.grad")
    for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters()):
        assert p.grad is not None and p_ref.grad is not None, name
        close(p.grad, p_ref.grad, msg=name)


@pytest.mark.parametrize("fused", [True, False], ids=["default", "plain"])
@pytest.mark.parametrize("overrides", [dict(), dict(pad_multiple=4, num_shared_experts=1)])
def test_hessian_vector_products_match_reference(overrides, fused):
    """``torch.autograd.functional.hvp`` (which differentiates the backward once more) and
    ``vhp`` of the loss with respect to the input, against the reference."""
    moe = make_moe(fused_routed_step=fused, **overrides)
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 7, D)
    v = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(4))
    for product in (torch.autograd.functional.hvp, torch.autograd.functional.vhp):
        _, hv = product(lambda x: moe(x).pow(2).sum(), x, v)
        _, hv_ref = product(lambda x: reference_moe(ref, x)[0].pow(2).sum(), x, v)
        close(hv, hv_ref, product.__name__)


@pytest.mark.parametrize("recompute", [False, True])
def test_second_backward_with_retain_graph(recompute):
    """The default path's rows are gathered again in each backward (Note [The routed SwiGLU in
    two steps]): a second backward through the same graph gives the reference's gradients
    again (accumulated twice)."""
    moe = make_moe(recompute_experts=recompute)
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 7, D)
    grads = []
    for m, fn in ((moe, lambda m, x: m(x)), (ref, lambda m, x: reference_moe(m, x)[0])):
        xi = x.clone().requires_grad_()
        y = fn(m, xi)
        y.pow(2).sum().backward(retain_graph=True)
        y.sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        close(a, b, "second backward")


def test_same_bits_run_to_run():
    moe = make_moe(top_k=3, num_shared_experts=1, aux_loss_coeff=0.01)
    x = torch.randn(3, 64, D)
    results = []
    for _ in range(2):
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        with collect_aux_losses() as aux:
            y = moe(xi)
        ((y * torch.arange(y.numel()).view_as(y).sin()).sum() + aux.total()).backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _grads(moe: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in moe.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpoint(use_reentrant):
    moe = make_moe(num_shared_experts=1, aux_loss_coeff=0.1, use_expert_bias=True, pad_multiple=4)
    moe_ckpt = copy.deepcopy(moe)
    x = torch.randn(2, 7, D, requires_grad=True)
    x_ckpt = x.detach().clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = moe(x)
    (y.square().sum() + aux.total()).backward()
    with collect_aux_losses() as aux:  # reentrant: nothing collected, the recompute attaches
        y = checkpoint(moe_ckpt, x_ckpt, use_reentrant=use_reentrant)
    (y.square().sum() + aux.total()).backward()
    for a, b in zip(_grads(moe, x), _grads(moe_ckpt, x_ckpt)):
        close(a, b)
    assert torch.equal(moe.router.tokens_per_expert, moe_ckpt.router.tokens_per_expert)
    assert moe_ckpt.router.tokens_per_expert.sum() == 2 * 7 * 2


def test_two_forwards_before_backward():
    """Two micro-batches in flight (different shapes) give the grads of two separate steps."""
    moe = make_moe(num_shared_experts=1, aux_loss_coeff=0.1, pad_multiple=4)
    moe_seq = copy.deepcopy(moe)
    x1, x2 = torch.randn(2, 7, D), torch.randn(1, 5, D)
    with collect_aux_losses() as aux1:
        y1 = moe(x1)
    with collect_aux_losses() as aux2:
        y2 = moe(x2)
    (y1.sum() + aux1.total() + 2 * (y2.sum() + aux2.total())).backward()
    for x_m, weight in ((x1, 1), (x2, 2)):
        with collect_aux_losses() as aux:
            y = moe_seq(x_m)
        (weight * (y.sum() + aux.total())).backward()
    for p, q in zip(moe.parameters(), moe_seq.parameters()):
        close(p.grad, q.grad)


_INIT_CONFIGS = [  # every parameter and buffer kind
    dict(num_shared_experts=1, shared_hidden_dim=64, use_expert_bias=True, capacity_factor=1.0),
    dict(score_func="sigmoid", shared_expert_gate=True, num_shared_experts=2,
         shared_hidden_dim=128),
]


@pytest.mark.parametrize("overrides", _INIT_CONFIGS)
def test_meta_init_then_reset_parameters(overrides):
    """Note [Meta-device init]: built on ``meta``, materialised by ``to_empty`` (garbage
    memory), then ``reset_parameters``: every parameter drawn afresh with ``init_std``, the
    expert bias and the counters zero, and a training step that counts its tokens."""
    cfg = MoEConfig(dim=D, hidden_dim=H, num_experts=64, top_k=2, init_std=0.3, **overrides)
    with torch.device("meta"):
        moe = MoE(cfg)
    assert all(t.is_meta for t in [*moe.parameters(), *moe.buffers()])
    moe.to_empty(device="cpu")
    with torch.no_grad():  # what uninitialised memory may hold
        for t in [*moe.parameters(), *moe.buffers()]:
            t.copy_(torch.full_like(t, 7))
    torch.manual_seed(0)
    moe.reset_parameters()
    small = []
    for name, p in moe.named_parameters():
        p = p.detach()
        assert not (p == 7).any(), name  # every element drawn afresh
        if p.numel() >= 1024:  # the configured distribution, weight by weight
            assert abs(float(p.std()) - 0.3) < 0.03 and abs(float(p.mean())) < 0.03, name
        else:  # the shared gate (16 values): pooled below
            small.append(p.reshape(-1))
    if small:
        pooled = torch.cat(small)
        assert abs(float(pooled.std()) - 0.3) < 0.1, [p.numel() for p in small]
    buffers = dict(moe.named_buffers())
    assert all(not b.any() for b in buffers.values()), buffers
    assert set(buffers) >= {"router.tokens_per_expert"}
    x = torch.randn(2, 7, D)
    moe(x).sum().backward()
    assert int(moe.router.tokens_per_expert.sum()) == 2 * 7 * 2
    assert all(p.grad is not None and p.grad.isfinite().all() for p in moe.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("overrides", _INIT_CONFIGS)
def test_device_and_dtype_factory_arguments(monkeypatch, overrides, dtype):
    """``MoE(config, device=, dtype=)`` makes every parameter and buffer there and so, as torch's
    modules do: in place (no module cast afterwards) and without touching torch's global
    defaults; the expert bias stays float32 and the counters int64. The layer then trains in
    that dtype."""
    def refuse(*_args):
        raise AssertionError("the layer must not change torch's process-wide defaults")

    cfg = MoEConfig(dim=D, hidden_dim=H, num_experts=8, top_k=2, **overrides)
    with monkeypatch.context() as m:
        m.setattr(torch, "set_default_dtype", refuse)
        m.setattr(torch, "set_default_device", refuse)
        m.setattr(torch.nn.Module, "_apply", refuse)  # made in place: no .to() cast after
        meta = MoE(cfg, device="meta", dtype=dtype)
        moe = MoE(cfg, device=torch.device("cpu"), dtype=dtype)
    for layer, device in ((meta, "meta"), (moe, "cpu")):
        params = dict(layer.named_parameters())
        assert len(params) >= 5 and all(
            p.device.type == device and p.dtype == dtype for p in params.values()
        ), {n: (p.device, p.dtype) for n, p in params.items()}
        buffers = dict(layer.named_buffers())
        expected = {"router.tokens_per_expert": torch.int64}
        if cfg.use_expert_bias:
            expected["router.expert_bias"] = torch.float32
        if cfg.has_capacity:
            expected["router.dropped_per_expert"] = torch.int64
        assert {n: b.dtype for n, b in buffers.items()} == expected
        assert all(b.device.type == device for b in buffers.values())
    assert torch.get_default_dtype() == torch.float32
    x = torch.randn(2, 5, D, dtype=dtype, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad.dtype == dtype and x.grad.isfinite().all()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in moe.parameters())


def test_factory_arguments_are_checked():
    cfg = MoEConfig(dim=D, hidden_dim=H, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=r"made in one of float16, bfloat16, float32, float64; "
                       r"got dtype=torch.float8_e4m3fn\. For float8 .* build in float32 and "
                       r"cast with \.to\(dtype\)"):
        MoE(cfg, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype must be a floating dtype, got dtype=torch.int32"):
        MoE(cfg, dtype=torch.int32)
    with pytest.raises(ValueError, match="device='gpu0' is not a device torch can use here"):
        MoE(cfg, device="gpu0")


def test_public_api_and_children():
    import dtensor_moe

    assert dtensor_moe.MoE is MoE and dtensor_moe.MoEConfig is MoEConfig
    assert {"MoE", "MoEConfig"} <= set(dtensor_moe.__all__)
    moe = dtensor_moe.MoE(dtensor_moe.MoEConfig(dim=256, hidden_dim=512, num_experts=8, top_k=2))
    assert moe.shared_experts is None
    assert moe.experts.w1.shape == (8, 512, 256)
    assert moe.experts.w2.shape == (8, 256, 512)
    assert moe.experts.w3.shape == (8, 512, 256)
    assert moe.router.gate.weight.shape == (8, 256)
    assert moe.experts.exchange.num_experts == 8
    x = torch.randn(2, 3, 256)
    assert moe(x).shape == (2, 3, 256)
    assert "expert_bias" not in moe.state_dict()


def test_update_expert_bias_from_optimizer_hook():
    moe = make_moe(use_expert_bias=True)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *_: update_expert_bias(moe, 0.01))
    moe(torch.randn(2, 7, D)).sum().backward()
    counts = moe.router.tokens_per_expert.clone()
    assert counts.sum() == 2 * 7 * 2
    opt.step()
    assert moe.router.tokens_per_expert.sum() == 0
    bias = moe.router.expert_bias
    expected = torch.sign(counts.double().mean() - counts.double())
    expected = (expected - expected.mean()) * 0.01
    torch.testing.assert_close(bias, expected.float())
    assert "router.expert_bias" in moe.state_dict()


@pytest.mark.parametrize("overrides", [dict(), dict(num_shared_experts=1, pad_multiple=4)])
def test_torch_func_grad_and_vjp_match_reference(overrides):
    """``torch.func.grad`` and ``torch.func.vjp`` through the layer (functional_call over its
    parameters): the experts take the plain path under the transform; input and parameter
    gradients against the per-token reference. In eval mode: a training forward adds to the
    router's counters in place, which a transform refuses for a captured buffer."""
    from torch.func import functional_call, grad, vjp

    moe = make_moe(**overrides).eval()
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 7, D)
    params = {n: p.detach() for n, p in moe.named_parameters()}

    def loss(params, x):
        return functional_call(moe, params, (x,)).pow(2).sum()

    grads = grad(loss, argnums=(0, 1))(params, x)
    x_ref = x.clone().requires_grad_()
    reference_moe(ref, x_ref)[0].pow(2).sum().backward()
    close(grads[1], x_ref.grad, "x grad")
    for name, p in ref.named_parameters():
        close(grads[0][name], p.grad, msg=name)
    y, pullback = vjp(lambda x: moe(x), x)
    (gx,) = pullback(torch.ones_like(y))
    x_ref.grad = None
    reference_moe(ref, x_ref)[0].sum().backward()
    close(gx, x_ref.grad, "vjp")


def test_other_work_between_dispatch_and_combine():
    """The stages exchange frozen values, so a caller can run other work between them: the
    shared experts between dispatch and compute give the layer's own output and gradients."""
    moe = make_moe(num_shared_experts=1)
    x = torch.randn(2, 7, D)
    x_layer, x_staged = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe(x_layer).pow(2).sum().backward()
    expected = [x_layer.grad] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    x_TD = x_staged.view(-1, D)
    routing = moe.router(x_TD, num_sequences=2, count=False)
    experts, exchange = moe.experts, moe.experts.exchange
    routed = exchange.dispatch(x_TD, routing.topk_scores_TK, routing.topk_ids_TK,
                                 routing.counts_E)
    shared_TD = moe.shared_experts(x_TD)  # other work, between dispatch and the experts
    assert exchange.receive(routed) is None  # one process: nothing in flight
    out_RD = compute(experts.plan, routed.source, routed.scores, routed.layout,
                     experts.local_weights())
    y = (exchange.combine(out_RD, routed) + shared_TD).view(2, 7, D)
    y.pow(2).sum().backward()
    got = [x_staged.grad] + [p.grad for p in moe.parameters()]
    for a, b in zip(got, expected, strict=True):
        close(a, b, "staged by hand")
