"""Dispatcher (round trip, grouping, padding, the Routed record, no state) and grouped expert
paths.

Shape legend: T tokens, D dim, E experts, K top_k, R routed rows, H hidden.
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dtensor_moe.moe import MoE, MoEConfig
from dtensor_moe.routed import (
    GroupedExperts,
    LocalExchange,
    Routed,
    grouped_swiglu,
    in_order,
    permute_tokens,
    resolve_compute_path,
    scores_in_rows,
    sort_by_expert,
    unpermute_and_reduce,
)
from dtensor_moe.routed.all_to_all import _InExpertOrder
from dtensor_moe.routed.experts import compute

D, H, E = 16, 32, 4


def routing(T: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids_TK = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.long)
    )
    scores_TK = torch.rand(T, K, generator=g)
    return scores_TK, ids_TK, torch.bincount(ids_TK.flatten(), minlength=E)


@pytest.mark.parametrize("pad_multiple", [1, 3, 8])
@pytest.mark.parametrize("K", [1, 2, E])
def test_round_trip(pad_multiple, K):
    """Identity experts that apply scores of 1/K: combine(dispatch(x)) == x.

    The combine sums each token's K rows unweighted (the experts apply the scores), so the
    rows as dispatched come back as K * x, and scaled by their scores as x."""
    x_TD = torch.randn(13, D)
    _, ids_TK, counts_E = routing(13, K)
    scores_TK = torch.full((13, K), 1.0 / K)
    dispatcher = LocalExchange(num_experts=E, pad_multiple=pad_multiple)
    routed = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    routed_RD, counts_e = permute_tokens(routed.source, routed.layout), routed.layout.counts_e
    scored_RD = routed_RD * scores_in_rows(routed.scores, routed.layout).unsqueeze(-1)
    torch.testing.assert_close(dispatcher.combine(scored_RD, routed), x_TD)
    torch.testing.assert_close(dispatcher.combine(routed_RD, routed), K * x_TD)
    assert int(counts_e.sum()) == routed_RD.shape[0]
    assert all(c % pad_multiple == 0 for c in counts_e.tolist())


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_rows_grouped_by_expert_in_token_order(pad_multiple):
    x_TD = torch.arange(11, dtype=torch.float32).unsqueeze(-1).expand(11, D).contiguous()
    scores_TK, ids_TK, counts_E = routing(11, 2)
    dispatcher = LocalExchange(num_experts=E, pad_multiple=pad_multiple)
    routed = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    routed_RD, counts_e = permute_tokens(routed.source, routed.layout), routed.layout.counts_e
    start = 0
    for i, (rows, real) in enumerate(zip(counts_e.tolist(), counts_E.tolist())):
        tokens = [t for t in range(11) if i in ids_TK[t].tolist()]
        group = routed_RD[start : start + rows, 0]
        assert group[:real].tolist() == tokens
        assert (routed_RD[start + real : start + rows] == 0).all()
        start += rows


def test_padding_never_reaches_output_or_grads():
    x_TD = torch.randn(9, D, requires_grad=True)
    scores_TK, ids_TK, counts_E = routing(9, 2)
    scores_TK.requires_grad_()
    layout = sort_by_expert(ids_TK, counts_E, pad_multiple=8)
    padding = torch.ones(layout.num_rows, dtype=torch.bool)
    padding[layout.row_TK.flatten()] = False
    dispatcher = LocalExchange(num_experts=E, pad_multiple=8)
    routed = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    routed_RD = permute_tokens(routed.source, routed.layout)
    out_RD = (routed_RD * 2).detach().requires_grad_()
    poisoned = out_RD.masked_fill(padding.unsqueeze(-1), float("nan"))
    y_TD = dispatcher.combine(poisoned, routed)
    assert torch.isfinite(y_TD).all()
    y_TD.sum().backward()
    assert (out_RD.grad[padding] == 0).all()
    grad_RD = torch.randn_like(routed_RD).masked_fill(padding.unsqueeze(-1), float("nan"))
    routed_RD.backward(grad_RD)
    assert torch.isfinite(x_TD.grad).all()


def test_dispatch_backward_sums_token_copies():
    x_TD = torch.randn(6, D, requires_grad=True)
    scores_TK, ids_TK, counts_E = routing(6, 3)
    routed = LocalExchange(num_experts=E, pad_multiple=5).dispatch(
        x_TD, scores_TK, ids_TK, counts_E
    )
    routed_RD = permute_tokens(routed.source, routed.layout)
    grad_RD = torch.randn_like(routed_RD)
    routed_RD.backward(grad_RD)
    expected = grad_RD[routed.row_TK].sum(dim=1)
    assert torch.equal(x_TD.grad, expected)


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_score_before_experts_scales_rows(pad_multiple):
    """``score_before_experts``: ``GroupedExperts.compute`` scales each row by its score before
    the experts (not their outputs after), and the combine does not apply the scores again."""
    x_TD = torch.randn(7, D)
    scores_TK, ids_TK, counts_E = routing(7, 2)
    dispatcher = LocalExchange(
        num_experts=E, pad_multiple=pad_multiple, score_before_experts=True
    )
    experts = GroupedExperts(
        dim=D, hidden_dim=H, num_experts=E, exchange=dispatcher, init_std=0.3
    )
    routed = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    with torch.no_grad():
        out_RD = compute(experts.plan, routed.source, routed.scores, routed.layout,
                         experts.local_weights())
        y_TD = dispatcher.combine(out_RD, routed)
        w1, w2, w3 = experts.local_weights()
        scaled_TKD = x_TD.unsqueeze(1) * scores_TK.unsqueeze(-1)
        want_TKD = torch.stack(
            [
                torch.stack(
                    [
                        (F.silu(v @ w1[e].T) * (v @ w3[e].T)) @ w2[e].T
                        for v, e in zip(scaled_TKD[t], ids_TK[t].tolist())
                    ]
                )
                for t in range(7)
            ]
        )
    torch.testing.assert_close(out_RD[routed.row_TK], want_TKD)
    torch.testing.assert_close(y_TD, want_TKD.sum(1))


def test_routed_is_frozen_kw_only_slots():
    scores_TK, ids_TK, counts_E = routing(3, 2)
    routed = LocalExchange(num_experts=E).dispatch(
        torch.randn(3, D), scores_TK, ids_TK, counts_E
    )
    assert isinstance(routed, Routed)
    with pytest.raises(dataclasses.FrozenInstanceError):
        routed.scores = None
    assert not hasattr(routed, "__dict__")
    with pytest.raises(TypeError):
        Routed(routed.source, routed.scores, routed.layout, routed.row_TK, routed.order_N)


def test_forward_leaves_no_state_on_modules():
    moe = MoE(
        MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=2, pad_multiple=4, num_shared_experts=1)
    )
    before = {name: dict(vars(m)) for name, m in moe.named_modules()}
    dispatcher_before = dict(vars(moe.experts.exchange))
    moe(torch.randn(2, 5, D)).sum().backward()
    for name, m in moe.named_modules():
        assert vars(m).keys() == before[name].keys(), name
        for key in ("_parameters", "_buffers", "_modules"):
            assert vars(m)[key].keys() == before[name][key].keys(), name
    assert vars(moe.experts.exchange) == dispatcher_before


def _weights(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, H, D, generator=g, dtype=dtype) * 0.3
    w2 = torch.randn(E, D, H, generator=g, dtype=dtype) * 0.3
    w3 = torch.randn(E, H, D, generator=g, dtype=dtype) * 0.3
    return [w.requires_grad_() for w in (w1, w2, w3)]


def _run(path: str, counts: list[int], dtype=torch.float32):
    torch.manual_seed(1)
    x_RD = torch.randn(sum(counts), D, dtype=dtype, requires_grad=True)
    ws = _weights(dtype=dtype)
    y = grouped_swiglu(x_RD, *ws, torch.tensor(counts), path)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
    return [y.detach(), x_RD.grad] + [w.grad for w in ws]


@pytest.mark.parametrize("counts", [[5, 0, 3, 9], [0, 0, 0, 0], [0, 0, 7, 0], [4, 4, 4, 4]])
def test_paths_agree(counts):
    """loop and grouped_mm agree bit for bit on CPU; bmm to float rounding."""
    loop = _run("loop", counts)
    for a, b in zip(_run("grouped_mm", counts), loop):
        assert torch.equal(a, b)
    if len(set(counts)) == 1:
        for a, b in zip(_run("bmm", counts), loop):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_paths_match_plain_math():
    counts = [2, 0, 3, 1]
    x_RD = torch.randn(6, D)
    w1, w2, w3 = (w.detach() for w in _weights())
    expected = []
    for i, x_cD in enumerate(x_RD.split(counts)):
        expected.append((F.silu(x_cD @ w1[i].T) * (x_cD @ w3[i].T)) @ w2[i].T)
    torch.testing.assert_close(grouped_swiglu(x_RD, w1, w2, w3, counts), torch.cat(expected))


def test_torch_grouped_mm_rejects_expanded_grad():
    """Documents the torch 2.13 CPU bug that Note [grouped_mm expanded grad] works around.

    If this test starts failing, torch fixed the bug and the workaround can go.
    """
    x_RD = torch.randn(8, D, requires_grad=True)
    w_EHD = torch.randn(E, H, D, requires_grad=True)
    offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Invalid strides/sizes"):
        torch._grouped_mm(x_RD, w_EHD.transpose(-2, -1), offs=offs).sum().backward()


def test_grouped_swiglu_accepts_expanded_grad():
    x_RD = torch.randn(8, D, requires_grad=True)
    ws = _weights()
    grouped_swiglu(x_RD, *ws, [2, 2, 1, 3], "grouped_mm").sum().backward()
    x_loop = x_RD.detach().clone().requires_grad_()
    ws_loop = [w.detach().clone().requires_grad_() for w in ws]
    grouped_swiglu(x_loop, *ws_loop, [2, 2, 1, 3], "loop").sum().backward()
    torch.testing.assert_close(x_RD.grad, x_loop.grad)
    for w, w_loop in zip(ws, ws_loop):
        torch.testing.assert_close(w.grad, w_loop.grad)


def test_bf16_paths_agree():
    counts = [5, 0, 3, 8]
    loop = _run("loop", counts, torch.bfloat16)
    for a, b in zip(_run("grouped_mm", counts, torch.bfloat16), loop):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_auto_path_choice():
    x_RD = torch.randn(8, D)
    w1 = torch.randn(E, H, D)
    assert resolve_compute_path("auto", x_RD, w1, [2, 2, 2, 2]) == "bmm"
    assert resolve_compute_path("auto", x_RD, w1, [0, 0, 0, 0]) == "grouped_mm"
    assert resolve_compute_path("auto", x_RD, w1, [1, 3, 2, 2]) == "grouped_mm"
    assert resolve_compute_path("auto", x_RD, w1, None) == "grouped_mm"
    odd = torch.randn(8, 6)
    assert resolve_compute_path("auto", odd, torch.randn(E, H, 6), [1, 3, 2, 2]) == "loop"
    assert resolve_compute_path("auto", x_RD.double(), w1.double(), [1, 3, 2, 2]) == "loop"


def test_float64_and_odd_dims_run_through_auto():
    for dtype, dim in ((torch.float64, D), (torch.float32, 6)):
        x_RD = torch.randn(6, dim, dtype=dtype)
        w1, w3 = torch.randn(E, H, dim, dtype=dtype), torch.randn(E, H, dim, dtype=dtype)
        w2 = torch.randn(E, dim, H, dtype=dtype)
        assert grouped_swiglu(x_RD, w1, w2, w3, [1, 2, 0, 3]).shape == (6, dim)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_combine_result_is_not_a_view(K, weighted):
    # FSDP2 warns when a wrapped module (the experts) returns a view, because an in-place op on
    # it would skip the pre-backward hook; the combine therefore returns a fresh tensor.
    T, width = 5, 4
    out_RD = torch.randn(T * K, width, requires_grad=True)
    row_TK = torch.randperm(T * K).view(T, K)
    scores_TK = torch.rand(T, K) if weighted else None
    y_TD = unpermute_and_reduce(out_RD, row_TK, scores_TK)
    assert not y_TD._is_view()
    want = out_RD[row_TK]
    want = want.sum(1) if scores_TK is None else (want * scores_TK.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(y_TD, want)


@pytest.mark.parametrize("T,K", [(13, 1), (13, 3), (0, 2)])
def test_combine_helpers_match_explicit_sums(T, K):
    """The one-pass combine helper (embedding_bag sums) against explicit float64 sums, with
    ``row_TK`` given as a transposed view and with rows that repeat (a void row)."""
    from dtensor_moe.routed.layouts import sum_rows

    g = torch.Generator().manual_seed(T + K)
    R = 2 * T + 1
    out_RD = torch.randn(R, D, generator=g)
    row_TK = torch.randint(0, R, (K, T), generator=g).t()  # a transposed view
    rows_TKD = out_RD.double()[row_TK]
    torch.testing.assert_close(sum_rows(out_RD, row_TK), rows_TKD.sum(1).float())


def test_layer_step_binds_no_autograd_function_signature():
    """``routed.layouts.PositionalFunction``: the layer's autograd Functions that define
    ``setup_context`` skip torch's per-call ``inspect.signature(...).bind`` in eager mode
    (none in a forward + backward), and still bind, as torch's ``Function.apply`` does, under a
    ``torch.func`` transform, whose results stay those of plain autograd. In eval mode: a
    training forward adds to the router's counters in place, which a transform refuses."""
    import inspect
    from unittest import mock

    from dtensor_moe import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2)).eval()
    x = torch.randn(2, 5, 16, requires_grad=True)
    calls = []
    real = inspect.signature

    def counting(fn, *args, **kwargs):
        calls.append(getattr(fn, "__qualname__", fn))
        return real(fn, *args, **kwargs)

    with mock.patch.object(inspect, "signature", counting):
        moe(x).square().sum().backward()
        eager = list(calls)
        params = {n: p.detach() for n, p in moe.named_parameters()}
        grads = torch.func.grad(
            lambda p: torch.func.functional_call(moe, p, (x.detach(),)).square().sum()
        )(params)
    assert eager == [], eager
    assert any("forward" in str(c) for c in calls[len(eager):]), calls
    for name, p in moe.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_eager_layer_calls_no_custom_op():
    """The package's ``torch.library`` ops (``dtensor_moe::grouped_mm``,
    ``grouped_mm_weight_grad``, ``swiglu_down``) are for ``torch.compile`` only: an eager
    forward + backward of the layer (default path, with recompute, and the plain path)
    dispatches none of them, and the ops are registered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtensor_moe import MoE, MoEConfig

    class Namespaces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.namespace)
            return func(*args, **(kwargs or {}))

    for options in ({}, {"recompute_experts": True}, {"fused_routed_step": False}):
        torch.manual_seed(0)
        moe = MoE(MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2, **options))
        x = torch.randn(2, 5, 16, requires_grad=True)
        with Namespaces() as mode:
            moe(x).square().sum().backward()
        assert "aten" in mode.seen and "dtensor_moe" not in mode.seen, (options, mode.seen)
    for name in ("grouped_mm", "grouped_mm_weight_grad", "swiglu_down"):
        assert hasattr(torch.ops.dtensor_moe, name), name


def test_in_order_layout_passes_rows_and_scores_through():
    """``in_order(layout)``: rows already in the buffer's order are taken as they are."""
    _, ids_TK, counts_E = routing(T=6, K=2)
    layout = in_order(sort_by_expert(ids_TK, counts_E))
    rows_RD, scores_R = torch.randn(12, D), torch.rand(12)
    assert permute_tokens(rows_RD, layout) is rows_RD
    assert torch.equal(scores_in_rows(scores_R, layout), scores_R)


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("create_graph", [False, True])
def test_received_rows_in_expert_order(pad_multiple, create_graph):
    """The received rows of an exchange and their weights, gathered from their packed
    ``(M, D + 1)`` buffer into local-expert order (padding rows zero), and the backward that
    writes both gradients into one packed buffer in arrival order (``index_select`` into its two
    views; ops that record a graph under ``create_graph``): against explicit indexing."""
    g = torch.Generator().manual_seed(3)
    M, e = 11, 3
    local_M1 = torch.randint(0, e, (M, 1), generator=g)
    layout = sort_by_expert(local_M1, torch.bincount(local_M1.reshape(-1), minlength=e),
                            pad_multiple=pad_multiple)  # fmt: skip
    packed = torch.randn(M, D + 1, generator=g, dtype=torch.float64, requires_grad=True)
    rows_RD, scores_R = _InExpertOrder.apply(packed, layout)
    row_M = layout.row_TK.reshape(-1)  # each arrival's row
    expected_rows = torch.zeros(layout.num_rows, D, dtype=torch.float64)
    expected_rows[row_M] = packed.detach()[:, :-1]
    expected_scores = torch.zeros(layout.num_rows, dtype=torch.float64)
    expected_scores[row_M] = packed.detach()[:, -1]
    assert torch.equal(rows_RD, expected_rows) and torch.equal(scores_R, expected_scores)
    grad_RD = torch.randn(layout.num_rows, D, generator=g, dtype=torch.float64)
    grad_R = torch.randn(layout.num_rows, generator=g, dtype=torch.float64)
    if create_graph:
        grad_RD.requires_grad_()
    (grad,) = torch.autograd.grad((rows_RD, scores_R), packed, (grad_RD, grad_R),
                                  create_graph=create_graph)  # fmt: skip
    assert torch.equal(grad[:, :-1], grad_RD.detach()[row_M])
    assert torch.equal(grad[:, -1], grad_R[row_M])
    assert grad.requires_grad == create_graph
