"""Note [MoE under torch.compile], single process: ``torch.compile`` of the MoE layer and of a
whole transformer block (the demo's) traces in fp32 and bf16, matches eager (output, ``x.grad``,
every param grad, router counters), also under activation checkpointing, with the graph breaks
pinned here."""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os

import expecttest
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from dtensor_moe import MoE, MoEConfig
from dtensor_moe.demo.model import Block, ModelConfig

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


def close(actual, expected, dtype, msg):
    tol = TOL[dtype]
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=msg)


def make_moe(dtype=torch.float32, **overrides) -> MoE:
    torch.manual_seed(0)
    fields = dict(dim=64, hidden_dim=128, num_experts=8, top_k=2, init_std=0.1)  # the default
    fields.update(overrides)
    return MoE(MoEConfig(**fields)).to(dtype)


def run(module, x, train=True, wrap=None):
    """Forward and backward; returns output, x.grad and param grads (by name)."""
    module.train(train)
    x = x.detach().clone().requires_grad_()
    y = wrap(module, x) if wrap is not None else module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    (y * g).sum().backward()
    grads = {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad
             for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def compiled_counts(fn, *args) -> tuple[int, int]:
    """(graphs, graph breaks) of one compiled call."""
    torch._dynamo.reset()
    counters.clear()
    fn(*args)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def assert_matches_eager(module, x, dtype, backend, train=True, wrap=None, what=""):
    module = copy.deepcopy(module)  # the caller's module is left as it was
    module.zero_grad(set_to_none=True)
    eager = copy.deepcopy(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    y, x_grad, grads = run(compiled, x, train, wrap)
    y_ref, x_grad_ref, grads_ref = run(eager, x, train, wrap)
    close(y, y_ref, dtype, f"{what}: output")
    close(x_grad, x_grad_ref, dtype, f"{what}: x.grad")
    for name, grad in grads_ref.items():
        close(grads[name], grad, dtype, f"{what}: {name}.grad")
    for (name, buf), (_, ref) in zip(module.named_buffers(), eager.named_buffers()):
        assert torch.equal(buf, ref), f"{what}: buffer {name}"  # router counters, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["auto", "loop"])
@pytest.mark.parametrize("train", [True, False])
def test_moe_compiles_and_matches_eager(dtype, path, train):
    moe = make_moe(dtype, compute_path=path)
    x = torch.randn(2, 13, 64).to(dtype)
    assert_matches_eager(moe, x, dtype, "aot_eager", train, what=f"{dtype} {path} {train}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_inductor(dtype):
    # the automatic aux-loss route, as run() adds no collected loss; tests/test_aux_loss.py
    # compiles the collected one
    moe = make_moe(dtype, num_shared_experts=1, aux_loss_coeff=0.01, use_expert_bias=True,
                   aux_loss_mode="attach")
    x = torch.randn(2, 13, 64).to(dtype)
    assert_matches_eager(moe, x, dtype, "inductor", what=f"{dtype} inductor")


def test_bmm_path_and_options_compile():
    # top_k == E gives every expert every token: the bmm path's equal counts
    cases = [dict(compute_path="bmm", top_k=8),
             dict(score_func="sigmoid", route_norm=True, num_expert_groups=4,
                  num_limited_groups=2, score_before_experts=True),
             dict(pad_multiple=4, num_shared_experts=2, shared_expert_gate=True)]
    for overrides in cases:
        moe = make_moe(**overrides)
        assert_matches_eager(moe, torch.randn(2, 9, 64), torch.float32, "aot_eager",
                             what=str(overrides))


def test_block_compiles_and_matches_eager_with_activation_checkpointing():
    config = ModelConfig(vocab_size=32, dim=64, n_layers=1, n_heads=4,
                         moe=MoEConfig(dim=64, hidden_dim=128, num_experts=8, top_k=2,
                                       num_shared_experts=1, init_std=0.1))
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(2, 11, 64)
    if FULL:  # CI compiles this same block with aot_eager in checkpoint(compile(block)) and
        # with inductor below; DTENSOR_MOE_FULL_MATRIX=1 adds it without the checkpoint around
        assert_matches_eager(block, x, torch.float32, "aot_eager", what="block")
    # torchtitan's order: checkpoint the block, then compile it
    assert_matches_eager(checkpoint_wrapper(block), x, torch.float32,
                         "aot_eager", what="compile(checkpoint_wrapper(block))")
    # and the other way round: eager checkpoint around the compiled layer; the recompute in
    # backward must not count tokens a second time (the buffers are compared too)
    assert_matches_eager(
        block, x, torch.float32, "aot_eager", what="checkpoint(compile(block))",
        wrap=lambda m, t: checkpoint(m, t, use_reentrant=False),
    )
    assert_matches_eager(block, x, torch.float32, "inductor", what="block inductor")


def test_graph_breaks_are_pinned():
    x = torch.randn(2, 13, 64)
    results = {}
    # CI: torch's default counting; nested_graph_breaks gives the same counts (see below):
    # DTENSOR_MOE_FULL_MATRIX=1 pins them too
    for nested in (False, True) if FULL else (False,):
        for path in ("auto", "loop", "pad4"):
            for train in (False, True):
                options = dict(pad_multiple=4) if path == "pad4" else dict(compute_path=path)
                moe = make_moe(**options).train(train)
                key = f"{'nested ' if nested else ''}{path} {'train' if train else 'eval'}"
                with torch._dynamo.config.patch(nested_graph_breaks=nested):
                    results[key] = compiled_counts(torch.compile(moe, backend="eager"), x)
    # (graphs, breaks), Note [MoE under torch.compile]. auto (grouped_mm): no break in eval; in
    # training the router counter update runs eagerly at the very end of the forward. loop:
    # the experts run eagerly (counts read on the host), one break, in which the counter update
    # runs too (so one in training as well). pad4 (pad_multiple=4): the padded layout needs host
    # counts, so dispatch, experts and combine run eagerly: one break, as for loop. The layer
    # calls the experts module eagerly from its own frame (Note [Eager islands under
    # torch.compile]), so torch's default counting (one break per nested frame around a
    # break) gives the same counts as nested_graph_breaks.
    lines = [f"{k}: graphs={g} breaks={b}" for k, (g, b) in results.items()]
    if FULL:
        expecttest.assert_expected_inline(
            "\n".join(line for line in lines if line.startswith("nested ")),
            """\
nested auto eval: graphs=1 breaks=0
nested auto train: graphs=1 breaks=1
nested loop eval: graphs=2 breaks=1
nested loop train: graphs=2 breaks=1
nested pad4 eval: graphs=2 breaks=1
nested pad4 train: graphs=2 breaks=1""",
        )
    expecttest.assert_expected_inline(
        "\n".join(line for line in lines if not line.startswith("nested ")),
        """\
auto eval: graphs=1 breaks=0
auto train: graphs=1 breaks=1
loop eval: graphs=2 breaks=1
loop train: graphs=2 breaks=1
pad4 eval: graphs=2 breaks=1
pad4 train: graphs=2 breaks=1""",
    )


def test_padding_island_does_not_recompile_for_new_counts():
    torch._dynamo.reset()
    counters.clear()
    moe = make_moe(pad_multiple=4).train()
    compiled = torch.compile(moe, backend="eager")
    eager = copy.deepcopy(moe)
    for seed in range(4):  # new data each time: new counts per expert
        x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(x), eager(x))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_fullgraph():
    x = torch.randn(2, 13, 64)
    torch._dynamo.reset()
    moe = make_moe().eval()
    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="eager")(x), moe(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"compile with fullgraph=False \(or run the forward in "
                       r"eval mode, which does not count\)"):
        torch.compile(make_moe().train(), fullgraph=True, backend="eager")(x)


def test_plain_grouped_mm_does_not_trace_in_float32():
    # Why dtensor_moe::grouped_mm exists (Note [grouped_mm under torch.compile]): torch 2.13's
    # fake implementation of torch._grouped_mm rejects float32. If this starts passing, the
    # custom op can go.
    x, w = torch.randn(8, 16), torch.randn(2, 16, 16)
    offs = torch.tensor([3, 8], dtype=torch.int32)

    def plain(x, w, offs):
        return torch._grouped_mm(x, w, offs=offs)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Expected inputs of BF16 type"):
        torch.compile(plain, backend="eager", fullgraph=True)(x, w, offs)


@pytest.mark.parametrize("path", ["loop", "pad4", "capacity"])
def test_island_calls_the_experts_module_eagerly(path):
    """Note [Eager islands under torch.compile]: where the routed experts read counts on the
    host, the compiled layer calls the experts *module* eagerly (its hooks run, outside any
    trace) and matches eager; where they do not, the module is traced."""
    options = {"loop": dict(compute_path="loop"), "pad4": dict(pad_multiple=4),
               "capacity": dict(capacity_factor=1.0)}[path]
    moe, x = make_moe(**options), torch.randn(2, 13, 64)
    seen = []
    moe.experts.register_forward_pre_hook(
        lambda module, args: seen.append(torch.compiler.is_compiling())
    )
    capacity = moe.router(x.view(-1, 64)).capacity
    assert moe.experts.runs_eagerly_under_compile(x.view(-1, 64), capacity)
    assert_matches_eager(moe, x, torch.float32, "aot_eager", what=path)
    assert seen == [False, False], seen  # the compiled call, then the eager one: no trace
    assert compiled_counts(torch.compile(moe.eval(), backend="eager"), x) == (2, 1)
    if path == "loop":  # fullgraph=True cannot hold the island: torch's error carries the
        torch._dynamo.reset()  # reason, which says what to set
        with pytest.raises(Exception, match=r"compile with fullgraph=False"):
            torch.compile(moe.eval(), fullgraph=True, backend="eager")(x)
    # the default layer, and a capacity padded to static shapes, trace their experts
    for options in ({}, dict(capacity_factor=1.0, pad_to_capacity=True)):
        other = make_moe(**options)
        capacity = other.router(x.view(-1, 64)).capacity
        assert not other.experts.runs_eagerly_under_compile(x.view(-1, 64), capacity), options


def test_experts_alone_and_a_users_experts_module_compile():
    """A ``GroupedExperts`` compiled on its own has no island of its own (the one island is the
    layer's): with padding, dynamo breaks the graph where the stages read counts on the host.
    An experts module without ``runs_eagerly_under_compile`` (a user's swap) is called as usual
    by the compiled layer."""
    moe, x = make_moe(pad_multiple=4), torch.randn(2, 13, 64)
    x_TD = x.view(-1, 64)
    routing = moe.router(x_TD)
    args = (x_TD, routing.topk_scores_TK.detach(), routing.topk_ids_TK, routing.counts_E)
    eager = moe.experts(*args)
    torch._dynamo.reset()
    compiled = torch.compile(moe.experts, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    # graphs and breaks at the host reads of the padded layout (no island below the layer's)
    assert compiled_counts(torch.compile(moe.experts, backend="eager"), *args) == (5, 4)

    class UsersExperts(torch.nn.Module):  # a forward-only swap: no runs_eagerly_under_compile
        def __init__(self, experts):
            super().__init__()
            self.inner = experts

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    for options in ({}, dict(compute_path="loop")):  # traced, and with an island inside
        moe = make_moe(**options)
        moe.experts = UsersExperts(moe.experts)
        assert_matches_eager(moe, x, torch.float32, "aot_eager", what=f"user's experts {options}")
    # the swap hides the experts' question from the layer, so the loop path's host read breaks
    # the traced graph where it happens (the layer's island is the only one there is); the
    # plan reads the counts once per forward (Note [One plan] in routed/experts.py)
    assert compiled_counts(torch.compile(moe.eval(), backend="eager"), x) == (5, 6)

