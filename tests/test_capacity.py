"""Expert capacity and token dropping in one process (Note [Expert capacity] in
``dtensor_moe/moe/capacity.py``): against a dense reference written here, with plain per-token
matmuls and a drop rule in plain Python; bit for bit against the dropless layer when nothing is
dropped; counters, ``load_stats``, activation checkpointing, ``torch.compile``, and errors.
The multi-process parity is in ``tests/test_capacity_dist.py``."""

# ruff: noqa: N806

from __future__ import annotations

import copy
import math
import os

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtensor_moe import MoE, MoEConfig
from dtensor_moe.moe import load_stats
from dtensor_moe.moe.capacity import expert_capacity
from tests.test_moe_compile import assert_matches_eager, compiled_counts

D, H, E, K = 8, 16, 4, 2
TOL = 1e-5


def make(seed=0, **overrides) -> MoE:
    fields = dict(dim=D, hidden_dim=H, num_experts=E, top_k=K, init_std=0.5,
                  capacity_factor=0.5)
    fields.update(overrides)
    torch.manual_seed(seed)
    return MoE(MoEConfig(**fields))


def reference_keep(ids_TK, scores_TK, capacity, policy):
    """The drop rule in plain Python: per expert, its pairs ranked by (-score, token) for
    "probs" or by token for "position"; the first ``capacity`` are kept."""
    T, Kk = ids_TK.shape
    keep = [[False] * Kk for _ in range(T)]
    for e in range(E):
        pairs = [(t, k) for t in range(T) for k in range(Kk) if int(ids_TK[t, k]) == e]
        if policy == "probs":
            pairs.sort(key=lambda tk: (-float(scores_TK[tk]), tk[0]))
        for t, k in pairs[:capacity]:
            keep[t][k] = True
    return keep


def reference_forward(moe: MoE, x: torch.Tensor, policy: str, factor: float, fixed=None):
    """Dense reference: softmax router, top-k, drop rule, per-token SwiGLU matmuls (on the
    scaled token with ``score_before_experts``). ``fixed``: the capacity, instead of one from
    ``factor``."""
    before = moe.config.score_before_experts
    B, L, _ = x.shape
    x_TD = x.reshape(-1, D)
    scores_TE = F.softmax(F.linear(x_TD, moe.router.gate.weight).float(), dim=-1)
    ids_TK = scores_TE.detach().topk(K, dim=-1).indices
    scores_TK = scores_TE.gather(-1, ids_TK)
    C = math.ceil(factor * B * L * K / E - 1e-9) if fixed is None else fixed
    keep = reference_keep(ids_TK, scores_TK.detach(), C, policy)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    dropped = [0] * E
    for t in range(B * L):
        y = x_TD.new_zeros(D)
        for k in range(K):
            e = int(ids_TK[t, k])
            if not keep[t][k]:
                dropped[e] += 1
                continue
            s = scores_TK[t, k]
            x_t = s * x_TD[t] if before else x_TD[t]
            out = w2[e] @ (F.silu(w1[e] @ x_t) * (w3[e] @ x_t))
            y = y + (out if before else s * out)
        rows.append(y)
    return torch.stack(rows).view(B, L, D), dropped


def grads(module, x, y_fn):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = y_fn(module, x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def close(actual, expected, msg):
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL * scale, msg=msg)


def test_expert_capacity():
    assert expert_capacity(10, top_k=2, num_experts=4, factor=0.5) == 3
    assert expert_capacity(8, top_k=2, num_experts=4, factor=1.0) == 4  # exact, no float bump
    assert expert_capacity(7, top_k=1, num_experts=7, factor=1.1) == 2
    assert expert_capacity(10, top_k=2, num_experts=4, factor=0.5, multiple=4) == 4
    assert expert_capacity(0, top_k=2, num_experts=4, factor=1.0) == 0


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("path", ["auto", "loop"])
@pytest.mark.parametrize("before", [False, True])
def test_matches_dense_reference(padded, policy, path, before):
    moe = make(drop_policy=policy, pad_to_capacity=padded, compute_path=path,
               score_before_experts=before, num_shared_experts=1, shared_hidden_dim=8)
    x = torch.randn(2, 7, D)
    y, x_grad, param_grads = grads(moe, x, lambda m, x: m(x))

    def ref_fn(m, x):
        y_ref, dropped = ref_fn.out = reference_forward(m, x, policy, 0.5)
        return y_ref + m.shared_experts(x)

    ref = copy.deepcopy(moe)
    y_ref, x_grad_ref, ref_grads = grads(ref, x, ref_fn)
    dropped = ref_fn.out[1]
    assert sum(dropped) > 0, "the case must drop some pairs"
    where = f"padded={padded} policy={policy} path={path} score_before_experts={before}"
    close(y, y_ref, f"{where}: output")
    close(x_grad, x_grad_ref, f"{where}: x.grad")
    for name, grad in ref_grads.items():
        close(param_grads[name], grad, f"{where}: {name}.grad")
    assert moe.router.dropped_per_expert.tolist() == dropped, where
    assert moe.router.tokens_per_expert.sum().item() == 2 * 7 * K  # the selection, pre-drop


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_fixed_capacity_matches_dense_reference(padded, policy):
    """``capacity_per_expert``: the same capacity for batches of every size (3 pairs per expert
    here, for 2 to 28 pairs per batch), against the reference with that capacity."""
    moe = make(capacity_factor=None, capacity_per_expert=3, drop_policy=policy,
               pad_to_capacity=padded)
    ref = copy.deepcopy(moe)
    for B, L in ((1, 1), (2, 3), (2, 7)):
        x = torch.randn(B, L, D)
        moe_before = moe.router.dropped_per_expert.clone()
        y, x_grad, param_grads = grads(moe, x, lambda m, x: m(x))
        out = {}

        def ref_fn(m, x, out=out):
            y_ref, out["dropped"] = reference_forward(m, x, policy, 0.0, fixed=3)
            return y_ref

        y_ref, x_grad_ref, ref_grads = grads(ref, x, ref_fn)
        where = f"padded={padded} policy={policy} B={B} L={L}"
        if B * L * K > 3 * E:
            assert sum(out["dropped"]) > 0, f"{where}: the case must drop some pairs"
        close(y, y_ref, f"{where}: output")
        close(x_grad, x_grad_ref, f"{where}: x.grad")
        for name, grad in ref_grads.items():
            close(param_grads[name], grad, f"{where}: {name}.grad")
        dropped = (moe.router.dropped_per_expert - moe_before).tolist()
        assert dropped == out["dropped"], where


@pytest.mark.parametrize("padded", [False, True])
def test_fixed_capacity_equals_factor_capacity(padded):
    """``capacity_per_expert=C`` is bit for bit the ``capacity_factor`` whose capacity is
    ``C`` for this batch, and rounds up to ``pad_multiple`` alike with ``pad_to_capacity``."""
    x = torch.randn(2, 7, D)
    extra = dict(pad_multiple=4) if padded else {}
    by_factor = make(capacity_factor=0.5, pad_to_capacity=padded, **extra)  # C = ceil(3.5) = 4
    fixed = make(capacity_factor=None, capacity_per_expert=3 if padded else 4,
                 pad_to_capacity=padded, **extra)  # padded: 3 rounds up to 4
    y0, gx0, g0 = grads(by_factor, x, lambda m, x: m(x))
    y1, gx1, g1 = grads(fixed, x, lambda m, x: m(x))
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0)
    assert all(torch.equal(g1[name], g0[name]) for name in g0)
    assert fixed.router.dropped_per_expert.tolist() == by_factor.router.dropped_per_expert.tolist()
    assert fixed.router.dropped_per_expert.sum() > 0
    assert "capacity_per_expert=" in repr(fixed.router)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_alignment_padding_without_pad_to_capacity(policy):
    """``pad_multiple > 1`` with a capacity but without ``pad_to_capacity``: the kept pairs'
    groups are aligned (``_capacity_rows``' third layout), same results as the reference."""
    moe = make(drop_policy=policy, pad_multiple=4)
    x = torch.randn(2, 7, D)
    y, x_grad, param_grads = grads(moe, x, lambda m, x: m(x))
    ref = copy.deepcopy(moe)
    y_ref, x_grad_ref, ref_grads = grads(
        ref, x, lambda m, x: reference_forward(m, x, policy, 0.5)[0]
    )
    close(y, y_ref, "output")
    close(x_grad, x_grad_ref, "x.grad")
    for name, grad in ref_grads.items():
        close(param_grads[name], grad, f"{name}.grad")


@pytest.mark.parametrize("padded", [False, True])
def test_enough_capacity_is_dropless(padded):
    dropless = make(capacity_factor=None)
    capped = make(capacity_factor=float(E), pad_to_capacity=padded)  # C = T * K: no drop
    x = torch.randn(2, 7, D)
    y0, gx0, g0 = grads(dropless, x, lambda m, x: m(x))
    y1, gx1, g1 = grads(capped, x, lambda m, x: m(x))
    if padded:  # zero rows change the matmul shapes: float rounding, as with pad_multiple
        close(y1, y0, "output")
        close(gx1, gx0, "x.grad")
        for name in g0:
            close(g1[name], g0[name], name)
    else:  # bit for bit
        assert torch.equal(y1, y0) and torch.equal(gx1, gx0)
        assert all(torch.equal(g1[name], g0[name]) for name in g0)
    assert capped.router.dropped_per_expert.sum().item() == 0


def test_dropped_pairs_get_no_gradient():
    """A token all of whose pairs are dropped gets zero output and zero input gradient."""
    moe = make(capacity_factor=0.25, drop_policy="position", top_k=1)
    x = torch.randn(1, 16, D, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    C = expert_capacity(16, top_k=1, num_experts=E, factor=0.25)
    routed = moe.router.tokens_per_expert - moe.router.dropped_per_expert
    assert routed.max().item() <= C
    zero_rows = (y.detach().abs().sum(-1) == 0).squeeze(0)
    assert int(zero_rows.sum()) == moe.router.dropped_per_expert.sum().item() > 0
    assert torch.all(x.grad[0, zero_rows] == 0)


def test_load_stats_reports_drops():
    moe = make()
    moe(torch.randn(2, 7, D))
    (stats,) = load_stats(moe, process_group="local")
    assert stats.dropped == moe.router.dropped_per_expert.sum().item() > 0
    assert stats.dropped_per_expert == tuple(moe.router.dropped_per_expert.tolist())
    assert "dropped" in stats.line()
    load_stats(moe, process_group="local", reset=True)
    assert moe.router.dropped_per_expert.sum().item() == 0


def test_activation_checkpointing_counts_once():
    moe = make()
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 7, D)
    y, gx, g = grads(moe, x, lambda m, x: checkpoint(m, x, use_reentrant=False))
    y_ref, gx_ref, g_ref = grads(ref, x, lambda m, x: m(x))
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert torch.equal(moe.router.dropped_per_expert, ref.router.dropped_per_expert)
    assert torch.equal(moe.router.tokens_per_expert, ref.router.tokens_per_expert)


@pytest.mark.parametrize("padded", [False, True])
def test_compile_matches_eager(padded):
    moe = make(pad_to_capacity=padded, dim=64, hidden_dim=128, num_experts=8)
    x = torch.randn(2, 13, 64)
    assert_matches_eager(moe, x, torch.float32, "aot_eager", what=f"padded={padded}")
    fixed = make(capacity_factor=None, capacity_per_expert=5, pad_to_capacity=padded, dim=64,
                 hidden_dim=128, num_experts=8)
    assert_matches_eager(fixed, x, torch.float32, "aot_eager", what=f"fixed, padded={padded}")


# CI: torch's default; nested_graph_breaks (DTENSOR_MOE_FULL_MATRIX=1) counts the same here, as
# for the dropless layer (tests/test_moe_compile.py::test_graph_breaks_are_pinned pins that in
# the full matrix too)
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


def test_compile_graph_breaks():
    x = torch.randn(2, 13, 64)
    results = {}
    for nested in (False, True) if FULL else (False,):
        for padded in (False, True):
            moe = make(pad_to_capacity=padded, dim=64, hidden_dim=128, num_experts=8).train()
            key = f"{'nested ' if nested else ''}{'padded' if padded else 'unpadded'}"
            with torch._dynamo.config.patch(nested_graph_breaks=nested):
                results[key] = compiled_counts(torch.compile(moe, backend="eager"), x)
    # (graphs, breaks) in training. pad_to_capacity: every shape is static, so the layer
    # breaks only where the dropless one does (the router counter update at the end).
    # Without it the routed buffer's length (the kept pairs) is read on the host, so dispatch,
    # experts and combine run as one eager island, as with pad_multiple > 1, and the counter
    # update runs in it: one break either way.
    lines = [f"{k}: graphs={g} breaks={b}" for k, (g, b) in results.items()]
    expecttest.assert_expected_inline(
        "\n".join(line for line in lines if not line.startswith("nested")),
        """\
unpadded: graphs=2 breaks=1
padded: graphs=1 breaks=1""",
    )
    if FULL:
        expecttest.assert_expected_inline(
            "\n".join(line for line in lines if line.startswith("nested")),
            """\
nested unpadded: graphs=2 breaks=1
nested padded: graphs=1 breaks=1""",
        )
    torch._dynamo.reset()
    moe = make(pad_to_capacity=True).eval()
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="eager")(x), moe(x))


def test_inductor_matches_eager():
    moe = make(pad_to_capacity=True, dim=64, hidden_dim=128, num_experts=8)
    assert_matches_eager(moe, torch.randn(2, 13, 64), torch.float32, "inductor", what="inductor")


def test_inductor_cumsum_dtype_bug():
    """Note [inductor cumsum dtype] in experts.py: the torch bug that ``_group_ends`` works
    around. If this starts failing, the plain ``cumsum(..., dtype=torch.int32)`` can come
    back."""

    def ends(n):
        return torch.cumsum(torch.full((4,), n, dtype=torch.int64), 0, dtype=torch.int32)

    torch._dynamo.reset()
    assert ends(3).dtype == torch.int32
    assert torch.compile(ends, backend="inductor")(3).dtype == torch.int64


def test_config_errors():
    with pytest.raises(ValueError, match="capacity_factor must be a positive finite"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_factor=0.0)
    with pytest.raises(ValueError, match="capacity_factor must be a positive finite"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_factor=float("inf"))
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="capacity_per_expert must be a positive int"):
            MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_per_expert=bad)
    with pytest.raises(ValueError, match="sets both capacity_factor=1.0 and capacity_per_exp"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_factor=1.0,
                  capacity_per_expert=4)
    assert MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_per_expert=4,
                     pad_to_capacity=True).has_capacity
    with pytest.raises(ValueError, match="drop_policy='random' is not one of"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_factor=1.0,
                  drop_policy="random")
    with pytest.raises(ValueError, match="pad_to_capacity=True needs a capacity"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, pad_to_capacity=True)
    with pytest.raises(TypeError, match="pad_to_capacity must be a bool"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=K, capacity_factor=1.0,
                  pad_to_capacity=1)
