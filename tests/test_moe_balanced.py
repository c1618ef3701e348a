"""``MoEConfig.force_balanced_routing``: the debug mode that sends tokens to experts round-robin.

One process: the forced ids and counts against ids written here (token ``t``'s ``k``-th expert
is ``(t * K + k) % E``), for softmax and for a DeepSeek-like sigmoid, group-limited, biased
config; the layer's output, input gradient, every parameter gradient and the balance loss
against a per-token reference built from those ids; the config check; no graph break; the
benchmark's ``--balanced`` flag. Four gloo ranks: every rank sends every expert the same number
of rows, and the parallel layer matches the single-process layer with the same config.

Shape legend: B sequences, L tokens per sequence, T = B * L, D dim, E experts, K top_k.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe.moe import MoE, MoEConfig, load_stats, update_expert_bias
from dtensor_moe.moe.balance import collect_aux_losses
from tests._dist import DistTestBase

ROOT = pathlib.Path(__file__).resolve().parent.parent
D, H = 16, 32
TOL = 1e-5


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Within 1e-5 relative, elementwise or to the tensor's largest magnitude."""
    atol = TOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=atol, msg=lambda m: f"{msg}\n{m}")


def expected_ids(T: int, K: int, E: int) -> list[list[int]]:
    """The round-robin assignment, written out: token ``t``'s ``k``-th expert."""
    return [[(t * K + k) % E for k in range(K)] for t in range(T)]


# name -> MoEConfig fields (dim, hidden_dim and init_std are added)
CONFIGS = {
    "softmax": dict(num_experts=4, top_k=2, num_shared_experts=1),
    "deepseek": dict(  # sigmoid, group-limited, expert bias, renormalised and scaled
        num_experts=8,
        top_k=2,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_expert_groups=4,
        num_limited_groups=2,
        use_expert_bias=True,
        num_shared_experts=1,
        aux_loss_coeff=0.1,
    ),
    "before_experts": dict(num_experts=6, top_k=3, score_before_experts=True, aux_loss_coeff=0.1),
    "top_k_is_e": dict(num_experts=4, top_k=4, route_norm=True),
}


def make_moe(name: str, seed: int = 0, **overrides) -> MoE:
    fields = dict(dim=D, hidden_dim=H, init_std=0.3, force_balanced_routing=True)
    fields.update(CONFIGS[name], **overrides)
    torch.manual_seed(seed)
    moe = MoE(MoEConfig(**fields))
    if moe.router.expert_bias is not None:  # a bias that would change normal selection
        with torch.no_grad():
            moe.router.expert_bias.copy_(torch.linspace(-1.0, 1.0, moe.config.num_experts))
    return moe


def _swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: ``sum_k w_k * expert_{id_k}(x)`` with the round-robin ids, the combine weights
    taken from the gate's scores of those experts (``route_norm``, ``route_scale``), plus the
    shared experts; and the sequence balance loss over those ids."""
    cfg, ex, sh = moe.config, moe.experts, moe.shared_experts
    B, L, _ = x.shape
    E, K = cfg.num_experts, cfg.top_k
    x_TD = x.reshape(B * L, D)
    logits_TE = (x_TD @ moe.router.gate.weight.T).float()
    scores_TE = logits_TE.softmax(-1) if cfg.score_func == "softmax" else logits_TE.sigmoid()
    ids = expected_ids(B * L, K, E)
    outs = []
    for t, x_D in enumerate(x_TD):
        w = scores_TE[t, ids[t]]
        if cfg.route_norm:
            w = w / w.sum()
        w = w * cfg.route_scale
        y_D = x_D.new_zeros(D)
        for w_k, i in zip(w, ids[t]):
            if cfg.score_before_experts:
                y_D = y_D + _swiglu(w_k * x_D, ex.w1[i], ex.w2[i], ex.w3[i])
            else:
                y_D = y_D + w_k * _swiglu(x_D, ex.w1[i], ex.w2[i], ex.w3[i])
        if sh is not None:
            y_D = y_D + _swiglu(x_D, sh.w1.weight, sh.w2.weight, sh.w3.weight)
        outs.append(y_D)
    aux = torch.zeros(())
    if cfg.aux_loss_coeff > 0:
        probs_TE = scores_TE
        if cfg.score_func == "sigmoid":
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        for b in range(B):
            hits = torch.zeros(E)
            for t in range(b * L, (b + 1) * L):
                hits[ids[t]] += 1
            f = hits * E / (K * L)
            aux = aux + (f * probs_TE[b * L : (b + 1) * L].mean(0)).sum()
        aux = cfg.aux_loss_coeff * aux / B
    return torch.stack(outs).view(B, L, D), aux


@pytest.mark.parametrize(
    ("name", "B", "L"),
    [("softmax", 2, 6), ("softmax", 1, 2), ("deepseek", 2, 8), ("deepseek", 3, 4),
     ("before_experts", 2, 4), ("top_k_is_e", 1, 5)],
)
def test_counts_are_equal_and_ids_are_round_robin(name, B, L):
    moe = make_moe(name)
    E, K = moe.config.num_experts, moe.config.top_k
    T = B * L
    assert T * K % E == 0  # the cases where every expert gets exactly the same count
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(1))
    routing = moe.router(x.reshape(T, D), num_sequences=B, count=False)
    assert routing.topk_ids_TK.tolist() == expected_ids(T, K, E)
    assert routing.topk_ids_TK.dtype == torch.int64
    assert routing.counts_E.tolist() == [T * K // E] * E
    assert all(len(set(row)) == K for row in routing.topk_ids_TK.tolist())  # no expert twice
    assert routing.topk_scores_TK.shape == (T, K) and routing.topk_scores_TK.dtype == x.dtype
    with collect_aux_losses():
        moe(x)
        moe(x)  # training forwards count the forced ids
    assert moe.router.tokens_per_expert.tolist() == [2 * T * K // E] * E
    assert load_stats(moe)[0].cv == 0.0


def test_uneven_counts_differ_by_at_most_one():
    moe = make_moe("deepseek")
    for T in (1, 3, 5, 7, 13):
        routing = moe.router(torch.randn(T, D), count=False)
        counts = routing.counts_E.tolist()
        assert sum(counts) == 2 * T and max(counts) - min(counts) <= 1, (T, counts)
        assert routing.topk_ids_TK.tolist() == expected_ids(T, 2, 8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_output_and_gradients_match_reference(name):
    moe = make_moe(name)
    ref = copy.deepcopy(moe)
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    with collect_aux_losses() as aux:
        y = moe(x)
    y_ref, aux_ref = reference(ref, x_ref)
    close(y, y_ref, "output")
    if moe.config.aux_loss_coeff > 0:
        close(moe.router.last_aux_loss, aux_ref, "balance loss")
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    ((y * g).sum() + aux.total()).backward()
    ((y_ref * g).sum() + aux_ref).backward()
    close(x.grad, x_ref.grad, "input grad")
    for (p_name, p), p_ref in zip(moe.named_parameters(), ref.parameters()):
        assert p.grad is not None, p_name
        close(p.grad, p_ref.grad, f"{p_name}.grad")
    gate_grad = moe.router.gate.weight.grad
    assert torch.isfinite(gate_grad).all() and gate_grad.abs().sum() > 0  # the gate learns


def test_changes_the_output_and_ignores_bias_and_groups():
    balanced = make_moe("deepseek")
    normal = make_moe("deepseek", force_balanced_routing=False)
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(4))
    with collect_aux_losses():
        y_balanced, y_normal = balanced(x), normal(x)
    assert not torch.allclose(y_balanced, y_normal)  # documented: outputs change
    # normal routing of this seed is not balanced; the forced one is, whatever the bias
    assert len(set(normal.router.tokens_per_expert.tolist())) > 1
    assert balanced.router.tokens_per_expert.tolist() == [4] * 8
    bias = balanced.router.expert_bias.clone()
    update_expert_bias(balanced, 1e-2)  # equal counts: the bias stays as it is
    assert torch.equal(balanced.router.expert_bias, bias)


def test_capacity_drops_nothing_when_balanced():
    moe = make_moe("softmax", capacity_factor=1.0, pad_to_capacity=True)
    x = torch.randn(2, 6, D)
    moe(x)
    assert moe.router.tokens_per_expert.tolist() == [6] * 4
    assert moe.router.dropped_per_expert.tolist() == [0] * 4


def test_config_check_and_repr():
    with pytest.raises(TypeError, match=r"force_balanced_routing must be a bool, got 1"):
        MoEConfig(dim=D, hidden_dim=H, num_experts=4, top_k=2, force_balanced_routing=1)
    assert MoEConfig(dim=D, hidden_dim=H, num_experts=4, top_k=2).force_balanced_routing is False
    assert "force_balanced_routing=True" in repr(make_moe("softmax").router)
    assert "force_balanced_routing" not in repr(make_moe("softmax", force_balanced_routing=False))


def test_no_graph_break_under_compile():
    torch._dynamo.reset()
    moe = make_moe("softmax").eval()
    x = torch.randn(2, 6, D)
    compiled = torch.compile(moe, fullgraph=True, backend="eager")
    close(compiled(x), moe(x), "compiled output")
    torch._dynamo.reset()


def _benchmark_module(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "moe_layer_bench", ROOT / "benchmarks" / "moe_layer.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_benchmark_balanced_flag(monkeypatch, capsys):
    bench = _benchmark_module(monkeypatch)
    small = ["--tokens", "32", "--dim", "16", "--hidden", "32", "--warmup", "1", "--repeats", "1"]
    # a parallel layout's ranks build their layer with the same _build(args)
    monkeypatch.setattr(sys, "argv", ["moe_layer.py", "--layout", "ep4", "--balanced", *small])
    moe, _, _ = bench._build(bench._parse())
    assert moe.config.force_balanced_routing is True
    monkeypatch.setattr(sys, "argv", ["moe_layer.py", *small])
    assert bench._build(bench._parse())[0].config.force_balanced_routing is False
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["moe_layer.py", "--balanced", *small])
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    header, rows = capsys.readouterr().out.splitlines()[:2]
    assert "routing=forced_balanced" in header, header
    assert rows.endswith("rows per expert: [8, 8, 8, 8, 8, 8, 8, 8]"), rows


class BalancedParallelTest(DistTestBase):
    @with_comms
    def test_every_rank_sends_every_expert_the_same_rows(self):
        from tests.test_parallel_moe import (
            LAYOUTS,
            Case,
            ParallelRun,
            as_param_grad,
            full,
            reduce_grad,
        )

        # L / tp * K is a multiple of E = 8: each rank's local round-robin picks the ids that
        # the single-process layer picks for the same tokens of the global batch
        for name, overlap in (("ep4", True), ("sp2ep2", False), ("tp2ep2", True)):
            run = ParallelRun(
                LAYOUTS[name], Case(2, 8, 2, 1), self.rank, overlap=overlap,
                force_balanced_routing=True, score_func="sigmoid", route_norm=True,
                num_expert_groups=4, num_limited_groups=2,
            )
            where = f"{name} overlap={overlap}"
            for what, (actual, expected) in run.forward_backward().items():
                close(actual, expected, f"{where}: {what}")
            # this rank routes 2 * 8 / tp tokens (its owned share under tp2ep2) x top-2
            per_expert = 2 * 8 // run.meshes.tp * 2 // 8
            (local,) = load_stats(run.model, process_group="local")
            self.assertEqual(list(local.counts), [per_expert] * 8, where)
            every = [None] * self.world_size
            dist.all_gather_object(every, local.counts)
            self.assertEqual(every, [local.counts] * self.world_size, where)
            (whole,) = load_stats(run.model)
            (expected,) = load_stats(run.ref, process_group="local")
            self.assertEqual(whole, expected, where)
            self.assertEqual(list(whole.counts), [4 * per_expert] * 8, where)
            # the gate's gradient, reduced as docs/parallelism.md says: the gate learns
            gate = run.model.router.gate.weight
            grad = full(as_param_grad(gate, reduce_grad("router.gate.weight", gate, run.meshes)))
            close(grad, run.ref.router.gate.weight.grad, f"{where}: gate grad")


if __name__ == "__main__":
    run_tests()
