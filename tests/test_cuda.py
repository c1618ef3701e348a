"""The product on a CUDA device, in one process: what the CPU suite cannot show.

These tests need a CUDA GPU and are skipped without one (CI has none). ``benchmarks/gpu.sh`` runs
them; ``docs/benchmarks.md`` ("On one GPU") says what a run on an H200 gave. They check, on the device:

- the MoE layer (fused routed step, plain routed step, loop path; fine-grained shapes with
  top-8, group-limited sigmoid routing with a bias, a shared expert) against a float64
  reference written here with plain torch ops, in float32 and bfloat16: output, ``x.grad`` and
  every parameter gradient;
- that the default step gives the plain step's output bits, and a second run the first run's
  bits;
- expert parallelism (EP4) on CUDA tensors, 4 processes sharing the GPU over gloo, against one
  process, with the all-to-all and the fixed-buffer exchanges, and the synchronizing CUDA calls
  of a training step counted (none with the fixed exchange);
- the options that reference does not model (capacity and dropping, recompute, scores before
  the experts, a gated shared expert, padding, router losses) against the same layer on the CPU,
  with the same routing and dropped pairs; and that the default path never syncs the host;
- the layer's forward and backward captured in one CUDA graph and replayed on new inputs,
  against eager steps;
- ``torch.compile`` (inductor, so Triton kernels) against eager, with the graph breaks counted;
- the fused Adam, AdamW and SGD CUDA kernels over DTensor params on several device meshes (a
  one-rank NCCL process group) against torch's own fused step on plain tensors, bit for bit and
  with no collective (Adagrad: where torch has no fused CUDA kernel, both sides must raise
  torch's error); ``GradScaler("cuda")`` and ``clip_grad_norm_`` over the same meshes;
- ``grouped_swiglu`` with its counts as host ints, a CPU tensor or a device tensor (the offsets
  follow the rows to the device).

``DTENSOR_MOE_TEST_DEVICE=cpu`` runs the same tests on the CPU with gloo (a check of the tests
themselves; the CPU suite covers the product there).
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_moe
from dtensor_moe import MoE, MoEConfig
from tests._optim_cases import OPTIM_CASES, make_optimizer
from tests.test_moe_layer import _swiglu

DEVICE = os.environ.get("DTENSOR_MOE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

# The GPU machines this file is run on may hold an older torch than the package's pin (2.13); the
# EP test's identical-tokens check calls torch 2.13's name for the functional all-gather, which
# torch 2.11 has under its older name. Test-only: on 2.13 this does nothing.
if not hasattr(_funcol, "all_gather_single"):
    _funcol.all_gather_single = _funcol.all_gather_tensor

# relative Frobenius error against the float64 reference
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

CONFIGS = {
    # Mixtral-like: 8 experts, top-2, softmax renormalised
    "mixtral": dict(num_experts=8, top_k=2, hidden_dim=128, route_norm=True),
    # Qwen3-like: 64 experts, top-8, softmax renormalised
    "qwen3": dict(num_experts=64, top_k=8, hidden_dim=64, route_norm=True),
    "qwen3_plain_step": dict(num_experts=64, top_k=8, hidden_dim=64, route_norm=True,
                             fused_routed_step=False),
    "qwen3_loop": dict(num_experts=64, top_k=8, hidden_dim=64, route_norm=True,
                       compute_path="loop"),
    # DeepSeek-V3-like: 64 experts in 8 groups of which 4 are used, top-8, sigmoid with a
    # correction bias, renormalised and scaled, one shared expert
    "deepseek": dict(num_experts=64, top_k=8, hidden_dim=32, score_func="sigmoid",
                     route_norm=True, route_scale=2.5, num_expert_groups=8,
                     num_limited_groups=4, use_expert_bias=True, num_shared_experts=1,
                     shared_hidden_dim=32),
}
DIM = 128
B, L = 2, 301  # 602 tokens: uneven per-expert counts


def make_moe(dtype: torch.dtype, **overrides) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=DIM, init_std=0.05, **overrides)).to(device=DEVICE, dtype=dtype)
    if moe.router.expert_bias is not None:  # a bias that changes the selection
        moe.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, moe.config.num_experts))
    return moe


def _selection(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Selected expert ids, from the gate logits computed as the layer computes them (the
    gate's own dtype; scores in float32), so that both sides pick the same experts."""
    cfg = moe.config
    with torch.no_grad():
        logits = F.linear(x_TD, moe.router.gate.weight).float()
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        if moe.router.expert_bias is not None:
            scores = scores + moe.router.expert_bias.float()
        if cfg.num_expert_groups is not None:
            G = cfg.num_expert_groups
            grouped = scores.view(scores.shape[0], G, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_score.topk(cfg.num_limited_groups, dim=-1).indices
            mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
            scores = grouped.masked_fill(mask[..., None], float("-inf")).view_as(scores)
        return scores.topk(cfg.top_k, dim=-1).indices


def reference(moe: MoE, x: torch.Tensor):
    """float64 forward and backward with plain torch ops; returns output, x.grad, param grads."""
    cfg = moe.config
    x_TD = x.detach().reshape(-1, DIM)
    ids_TK = _selection(moe, x_TD)
    p = {n: q.detach().double().requires_grad_() for n, q in moe.named_parameters()}
    x64 = x_TD.double().requires_grad_()
    logits = x64 @ p["router.gate.weight"].T
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    w_TK = scores.gather(1, ids_TK)
    if cfg.route_norm:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    w_TK = w_TK * cfg.route_scale
    y = torch.zeros_like(x64)
    for e in range(cfg.num_experts):
        t, k = (ids_TK == e).nonzero(as_tuple=True)
        out = _swiglu(x64[t], p["experts.w1"][e], p["experts.w2"][e], p["experts.w3"][e])
        y = y.index_add(0, t, w_TK[t, k, None] * out)
    if cfg.num_shared_experts:
        y = y + _swiglu(x64, p["shared_experts.w1.weight"], p["shared_experts.w2.weight"],
                        p["shared_experts.w3.weight"])
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y * g.to(y.device)).sum().backward()
    return y.view(x.shape), x64.grad.view(x.shape), {n: q.grad for n, q in p.items()}


def run_layer(moe: MoE, x: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    y = moe(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y * g.to(y.device, y.dtype)).sum().backward()
    module = getattr(moe, "_orig_mod", moe)  # a torch.compile wrapper: the module's own names
    return y.detach(), x.grad, {n: q.grad for n, q in module.named_parameters()}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double()
    diff = (actual.detach().double() - expected).norm()
    return float(diff / expected.norm().clamp_min(1e-30))


def _x(dtype):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(B, L, DIM, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_float64_reference(name, dtype):
    _check_against_reference(make_moe(dtype, **CONFIGS[name]), dtype, name)


def _check_against_reference(moe: MoE, dtype: torch.dtype, label: str) -> None:
    """One training step of ``moe`` on ``_x(dtype)``: output, ``x.grad`` and every parameter
    gradient within ``REL_TOL[dtype]`` of :func:`reference`."""
    x = _x(dtype)
    y, x_grad, grads = run_layer(moe, x)
    y_ref, x_grad_ref, grads_ref = reference(moe, x)
    assert y.device.type == DEVICE and y.dtype == dtype
    errors = {"output": rel_err(y, y_ref), "x.grad": rel_err(x_grad, x_grad_ref)}
    for n, ref in grads_ref.items():
        if "expert_bias" in n:
            continue
        assert grads[n] is not None, n
        errors[n] = rel_err(grads[n], ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] < REL_TOL[dtype], f"{label} {dtype}: {errors}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_fused_step_bits_equal_plain_step_and_rerun(name, dtype):
    """The default (staged) step gives the plain step's output bits and its own bits on a
    rerun; its gradients round differently from the plain step's (the score gradient comes
    from the down projection's input gradient), and both are checked against the float64
    reference in test_layer_matches_float64_reference."""
    x = _x(dtype)
    fused = run_layer(make_moe(dtype, **CONFIGS[name]), x)
    again = run_layer(make_moe(dtype, **CONFIGS[name]), x)
    plain = run_layer(make_moe(dtype, **CONFIGS[name], fused_routed_step=False), x)
    assert torch.equal(fused[0], plain[0]), "plain step: output"
    assert torch.equal(fused[0], again[0]), "rerun: output"
    assert torch.equal(fused[1], again[1]), "rerun: x.grad"
    for n, grad in fused[2].items():
        assert torch.equal(grad, again[2][n]), f"rerun: {n}.grad"


def test_made_on_the_device_in_bf16():
    """``MoE(config, device=, dtype=)`` makes the layer on the device, in bf16 (the expert bias in
    float32), with no copy from the CPU, and it trains there like one cast with ``.to``."""
    cfg = MoEConfig(dim=DIM, init_std=0.05, **CONFIGS["deepseek"])
    moe = MoE(cfg, device=DEVICE, dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in moe.parameters()} == {(DEVICE, torch.bfloat16)}
    assert moe.router.expert_bias.dtype == torch.float32
    assert moe.router.expert_bias.device.type == DEVICE
    _check_against_reference(moe, torch.bfloat16, "made on the device")


def test_module_cast_to_the_device_keeps_the_expert_bias_float32():
    """Note [Expert bias keeps its dtype] across devices: ``.to(device, bf16)`` moves the bias to
    the device with its float32 values, and the layer routes with it there."""
    cfg = MoEConfig(dim=DIM, init_std=0.05, **CONFIGS["deepseek"])
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts) + 1e-6)
    bias = moe.router.expert_bias.clone()
    moe.to(device=DEVICE, dtype=torch.bfloat16)
    assert moe.router.gate.weight.dtype == torch.bfloat16
    assert moe.router.expert_bias.dtype == torch.float32
    assert moe.router.expert_bias.device.type == DEVICE
    assert torch.equal(moe.router.expert_bias.cpu(), bias)
    y = moe(_x(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.isfinite().all()


@pytest.mark.parametrize("kind", ["list", "cpu tensor", "device tensor"])
def test_grouped_swiglu_takes_counts_from_anywhere(kind):
    """The public ``grouped_swiglu`` on device rows, with its counts as host ints, a CPU tensor
    or a device tensor (``_swiglu_grouped_mm`` moves them to the rows' device), against
    per-expert matmuls."""
    from dtensor_moe.routed import grouped_swiglu

    gen = torch.Generator().manual_seed(3)
    E, H, R = 4, 32, 50
    counts = [20, 0, 13, 17]
    x, w1, w3 = (torch.randn(*s, generator=gen).to(DEVICE) for s in
                 ((R, DIM), (E, H, DIM), (E, H, DIM)))
    w2 = torch.randn(E, DIM, H, generator=gen).to(DEVICE)
    given = {"list": counts, "cpu tensor": torch.tensor(counts),
             "device tensor": torch.tensor(counts, device=DEVICE)}[kind]
    out = grouped_swiglu(x, w1, w2, w3, given, path="grouped_mm")
    bounds = [0, 20, 20, 33, 50]
    expected = torch.cat([_swiglu(x[bounds[e]:bounds[e + 1]].double(), w1[e].double(),
                                  w2[e].double(), w3[e].double()) for e in range(E)])
    assert out.device.type == DEVICE
    assert rel_err(out, expected) <= REL_TOL[torch.float32]


# Options the float64 reference above does not model: on the device they must give what the same
# layer gives on the CPU (where tests/test_moe_layer.py, test_capacity.py and test_router_losses.py
# check them against their own references), in float32.
DEVICE_OPTIONS = {
    "capacity_probs_padded": dict(capacity_factor=0.5, pad_to_capacity=True),
    "capacity_position": dict(capacity_factor=0.75, drop_policy="position"),
    "recompute_experts": dict(recompute_experts=True),
    "score_before_experts": dict(score_before_experts=True),
    "shared_expert_gate": dict(num_shared_experts=1, shared_hidden_dim=32,
                               shared_expert_gate=True),
    "pad_multiple": dict(pad_multiple=8),
    "router_losses": dict(aux_loss_coeff=0.01, z_loss_coeff=0.001),
}


@pytest.mark.parametrize("name", sorted(DEVICE_OPTIONS))
def test_options_on_the_device_match_the_cpu(name):
    from dtensor_moe.moe import load_stats
    from dtensor_moe.moe.balance import collect_aux_losses

    overrides = {**CONFIGS["qwen3"], **DEVICE_OPTIONS[name]}
    results = []
    for device in (DEVICE, "cpu"):
        torch.manual_seed(0)
        moe = MoE(MoEConfig(dim=DIM, init_std=0.05, **overrides)).to(device)
        x = _x(torch.float32).to(device).requires_grad_()
        with collect_aux_losses() as aux:
            y = moe(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
        ((y * g).sum() + aux.total()).backward()
        stats = load_stats(moe, process_group="local")
        results.append((y, x.grad, {n: q.grad for n, q in moe.named_parameters()},
                        [(s.counts, s.dropped_per_expert) for s in stats]))
    (y, x_grad, grads, stats), (y_cpu, x_grad_cpu, grads_cpu, stats_cpu) = results
    assert str(stats) == str(stats_cpu)  # the same routing and the same dropped pairs
    errors = {"output": rel_err(y.cpu(), y_cpu), "x.grad": rel_err(x_grad.cpu(), x_grad_cpu)}
    errors.update({n: rel_err(g.cpu(), grads_cpu[n]) for n, g in grads.items()})
    assert max(errors.values()) <= REL_TOL[torch.float32], errors


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's sync debug mode")
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_default_path_does_not_sync_the_host(name):
    """One process, default config, device counts: no step reads the device from the host."""
    moe = make_moe(torch.bfloat16, **CONFIGS[name])
    x = _x(torch.bfloat16).requires_grad_()
    g = torch.randn_like(x)
    moe(x).backward(g)  # warm: lazy inits may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).backward(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_layer_step_captured_in_a_cuda_graph(name, dtype):
    """One process: the layer's forward and backward captured whole in one CUDA graph (no host
    read may happen inside a capture), then replayed on new inputs: output, ``x.grad`` and every
    parameter gradient equal to eager steps of a copy of the layer on the same inputs.

    Where torch's own ``_grouped_mm`` reads its offsets on the host for ``dtype`` (float32 on
    torch 2.11's CUDA build: its fallback copies them to the CPU), no capture of it can hold:
    the capture must then fail at that copy, and does nothing else wrong."""
    _small_grouped_mm(dtype)  # warm: lazy inits may sync once
    if _host_syncs(lambda: _small_grouped_mm(dtype)):
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            _captured_step(name, dtype)
        return
    _captured_step(name, dtype)


def _small_grouped_mm(dtype: torch.dtype) -> None:
    x = torch.randn(64, 32, device=DEVICE, dtype=dtype)
    w = torch.randn(4, 32, 16, device=DEVICE, dtype=dtype)
    offs = torch.tensor([16, 32, 40, 56], device=DEVICE, dtype=torch.int32)
    torch.cuda.synchronize()
    torch._grouped_mm(x, w, offs=offs)


def _captured_step(name: str, dtype: torch.dtype) -> None:
    moe = make_moe(dtype, **CONFIGS[name])
    eager = copy.deepcopy(moe)
    static_x = _x(dtype).requires_grad_()
    gen = torch.Generator().manual_seed(1)
    static_g = torch.randn(static_x.shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)

    def step():
        static_x.grad = None
        moe.zero_grad(set_to_none=True)
        y = moe(static_x)
        y.backward(static_g)
        return y

    side = torch.cuda.Stream()  # warm up off the default stream, as torch's docs do
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    moe.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_y = moe(static_x)
        static_y.backward(static_g)
    for seed in (3, 4):
        new_x = torch.randn(static_x.shape, generator=torch.Generator().manual_seed(seed))
        new_x = new_x.to(DEVICE, dtype)
        with torch.no_grad():
            static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        y, x_grad, grads = run_layer(eager, new_x)
        errors = {"output": rel_err(static_y, y), "x.grad": rel_err(static_x.grad, x_grad)}
        errors.update({n: rel_err(q.grad, grads[n]) for n, q in moe.named_parameters()})
        assert max(errors.values()) <= REL_TOL[dtype], (seed, errors)


# ---- optimizers, GradScaler and grad clipping over several meshes -------------------------


@pytest.fixture(scope="module")
def meshes():
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=store, rank=0,
                                world_size=1)
        try:
            mesh2d = init_device_mesh(DEVICE, (1, 1), mesh_dim_names=("dp", "tp"))
            world = init_device_mesh(DEVICE, (1,), mesh_dim_names=("world",))
            yield {"world": world, "2d": mesh2d, "tp": mesh2d["tp"]}
        finally:
            dist.destroy_process_group()


LAYOUT = [  # (mesh, shape, placements)
    ("world", (64, 33), [Shard(0)]),
    ("world", (17,), [Replicate()]),
    ("tp", (128, 8), [Shard(1)]),
    ("2d", (40, 24), [Shard(0), Shard(1)]),
    ("2d", (9, 7), [Replicate(), Shard(0)]),
]


def _dtensor_params(meshes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [
        distribute_tensor(torch.randn(shape, generator=gen).to(DEVICE, dtype), meshes[key],
                          placements).requires_grad_()
        for key, shape, placements in LAYOUT
    ]


def _grads(step, like):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype) for p in like]


@pytest.mark.parametrize("label,cls_name,kwargs", OPTIM_CASES, ids=[c[0] for c in OPTIM_CASES])
def test_fused_optimizer_over_meshes_matches_torch(meshes, label, cls_name, kwargs):
    params = _dtensor_params(meshes)
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    opt = make_optimizer(cls_name, params, kwargs, "fused")
    ref = make_optimizer(cls_name, plain, kwargs, "fused")
    for step in range(3):
        for p, q, g in zip(params, plain, _grads(step, plain)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            q.grad = g.clone()
        try:
            ref.step()
        except RuntimeError as err:  # torch has no fused kernel of it here (Adagrad on CUDA)
            assert DEVICE != "cpu" and cls_name == "Adagrad", err
            with pytest.raises(RuntimeError, match=re.escape(str(err))):  # the same refusal
                opt.step()
            return
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
    for i, (p, q) in enumerate(zip(params, plain)):
        assert p.to_local().device.type == DEVICE
        assert torch.equal(p.to_local(), q), f"{label}: param {i}"
        for key, value in opt.state[p].items():
            local = value.to_local() if hasattr(value, "to_local") else value
            assert torch.equal(local, ref.state[q][key]), f"{label}: param {i} state {key}"


@pytest.mark.parametrize("inf", [False, True])
def test_grad_scaler_and_clipping_over_meshes(meshes, inf):
    params = _dtensor_params(meshes)
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    scalers = [torch.amp.GradScaler(DEVICE, init_scale=8.0) for _ in range(2)]
    opts = [torch.optim.AdamW(ps, lr=0.01, fused=True) for ps in (params, plain)]
    grads = _grads(0, plain)
    if inf:
        grads[3][5, 2] = float("inf")  # on the 2-D mesh
    norms = []
    for ps, scaler, opt, clip in zip((params, plain), scalers, opts,
                                     (dtensor_moe.clip_grad_norm_,
                                      torch.nn.utils.clip_grad_norm_)):
        scaler.scale(torch.ones((), device=DEVICE))  # initializes the scale
        for p, g in zip(ps, grads):
            g = g * 8.0
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if ps is params else g
        scaler.unscale_(opt)
        norms.append(clip(ps, max_norm=1.0))
        scaler.step(opt)
        scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == (4.0 if inf else 8.0)
    if inf:
        assert not torch.isfinite(norms[0]) and not torch.isfinite(norms[1])
    else:
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    for i, (p, q) in enumerate(zip(params, plain)):
        torch.testing.assert_close(p.to_local(), q.detach(), rtol=1e-6, atol=1e-7,
                                   msg=f"param {i}")


# ---- torch.compile (last: the slowest) ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_inductor_matches_eager(name, dtype):
    import torch._dynamo
    from torch._dynamo.utils import counters

    moe = make_moe(dtype, **CONFIGS[name])
    x = _x(dtype)
    eager = run_layer(copy.deepcopy(moe), x)
    torch._dynamo.reset()
    counters.clear()
    compiled = run_layer(torch.compile(moe), x)
    breaks = sum(counters["graph_break"].values())
    print(f"\n{name} {dtype}: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks "
          f"{dict(counters['graph_break'])}")
    assert breaks <= 1, dict(counters["graph_break"])  # the single-process promise
    errors = {"output": rel_err(compiled[0], eager[0]), "x.grad": rel_err(compiled[1], eager[1])}
    errors.update({n: rel_err(g, eager[2][n]) for n, g in compiled[2].items()})
    assert max(errors.values()) <= REL_TOL[dtype], errors


EP_RANK_TIMEOUT_S = int(os.environ.get("DTENSOR_MOE_EP_TIMEOUT", "120"))  # seconds


def _host_syncs(step) -> list[str]:
    """The synchronizing CUDA calls this thread makes in ``step()`` (CUDA's sync debug mode,
    warnings), each as ``file:line: message``. Only this thread's calls: gloo copies CUDA
    tensors through host memory in threads of its own, which the mode does not report here."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in seen
            if "called a synchronizing" in str(w.message)]


def _ep_worker(rank: int, world: int, port: int, exchange: str, results) -> None:
    """One rank of :func:`test_expert_parallel_on_the_device_matches_one_process`."""
    import faulthandler

    from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

    # a rank stuck in a collective prints every thread's stack and exits, so the test fails
    # with the place it hung (the parent waits longer than this)
    faulthandler.dump_traceback_later(EP_RANK_TIMEOUT_S, exit=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(0)
        cfg = MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, route_norm=True,
                        num_shared_experts=1)
        ref = MoE(cfg).to(DEVICE)
        moe = copy.deepcopy(ref)
        parallelize_moe(moe, build_moe_meshes(dp=world, ep=world, device_type=DEVICE),
                        sequence_parallel=False, exchange=exchange)
        gen = torch.Generator().manual_seed(1)
        xs = torch.randn(world, 2, 16, 64, generator=gen).to(DEVICE)
        gs = torch.randn(world, 2, 16, 64, generator=gen).to(DEVICE)
        x = xs[rank].clone().requires_grad_()
        moe(x).backward(gs[rank])
        x_ref = xs.clone().requires_grad_()
        ref(x_ref.view(world * 2, 16, 64)).backward(gs.view(world * 2, 16, 64))
        errors = {"x.grad": float((x.grad - x_ref.grad[rank]).abs().max())}
        for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            if not name.startswith("experts."):  # replicated: each rank's share of the sum
                dist.all_reduce(grad)
            errors[name] = float((grad - q.grad).abs().max() / q.grad.abs().max())
        syncs = None
        if DEVICE == "cuda":  # in bf16, as test_default_path_does_not_sync_the_host: a training
            # step after a first one (where the fixed exchange agrees on its buffer size)
            fast = MoE(cfg).to(DEVICE, torch.bfloat16)
            parallelize_moe(fast, build_moe_meshes(dp=world, ep=world, device_type=DEVICE),
                            sequence_parallel=False, exchange=exchange)
            x16, g16 = x.detach().bfloat16().requires_grad_(), gs[rank].bfloat16()
            fast(x16).backward(g16)
            torch.cuda.synchronize()
            syncs = _host_syncs(lambda: fast(x16).backward(g16))
            torch.cuda.synchronize()
        results.put((rank, (errors, syncs)))
    except Exception:  # reported by the test, rather than a timeout of the others
        import traceback

        results.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("exchange", ["all_to_all", "fixed"])
def test_expert_parallel_on_the_device_matches_one_process(exchange):
    """EP4 on CUDA tensors: 4 processes share the GPU over gloo (NCCL refuses two ranks on one
    device; gloo's all-to-all takes CUDA tensors): input and every parameter gradient against
    the same layer in one process on the device, with the all-to-all exchange and the
    fixed-buffer one. Then the synchronizing CUDA calls of one more training step, per rank
    (CUDA's sync debug mode): none with the fixed exchange; the all-to-all exchange reads its
    exchange sizes on the host, forward and backward."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ep_worker, args=(r, 4, port, exchange, results))
             for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, errors = results.get(timeout=EP_RANK_TIMEOUT_S + 30)
        assert not isinstance(errors, str), f"rank {rank}:\n{errors}"
        got[rank] = errors
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
    for rank, (errors, syncs) in sorted(got.items()):
        for name, err in errors.items():
            assert err < 1e-5, (rank, name, err)
        if syncs is not None:
            print(f"\n{exchange} rank {rank}: {len(syncs)} synchronizing CUDA calls in a step")
            for line in syncs:
                print("   ", line)
            if exchange == "fixed":
                assert syncs == [], syncs
            else:  # the sizes read on the host: the detector sees them
                assert syncs, "the sync debug mode saw no host read of the all-to-all exchange"
