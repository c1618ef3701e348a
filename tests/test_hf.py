"""``dtensor_moe.hf``: HF MoE blocks swapped for ``MoE`` give the same model, and back.

Every family is a tiny random ``AutoModelForCausalLM`` built from its config class (no
download). The reference is the untouched HF model (a deep copy taken before the swap).
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dtensor_moe import MoE, hf  # the test extra includes the hf extra: no skip
from tests._hf_models import ALL, FAMILIES, hf_config, hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Within 1e-5 relative to the largest magnitude of ``expected`` (fp32)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL * scale, msg=msg)


def _output(model, **inputs) -> torch.Tensor:
    """Logits of a causal LM, or the last hidden state of a text model (multimodal families)."""
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _forward_backward(model, ids, grad_seed=1):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = _output(model, inputs_embeds=emb)
    g = torch.randn(logits.shape, generator=torch.Generator().manual_seed(grad_seed))
    (logits * g).sum().backward()
    return logits.detach(), emb.grad


def _blocks(model) -> list[str]:
    """Names of the modules that are a supported family's block."""
    return [n for n, m in model.named_modules() if any(f.matches(m) for f in hf._FAMILIES)]


@pytest.mark.parametrize("model_type", ALL)
def test_swapped_model_matches_hf(model_type):
    ref = hf_model(model_type)
    model = copy.deepcopy(ref)
    names = hf.replace_moe_blocks(model)
    assert names == _blocks(ref) and names, (names, _blocks(ref))
    if model_type in FAMILIES:
        sparse_layers = [1] if model_type in ("deepseek_v3", "glm4_moe") else [0, 1]
        assert names == [f"model.layers.{i}.mlp" for i in sparse_layers]
    for name in names:
        assert isinstance(model.get_submodule(name), MoE), name
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    logits, x_grad = _forward_backward(model, ids)
    ref_logits, ref_x_grad = _forward_backward(ref, ids)
    close(logits, ref_logits, f"{model_type}: logits")
    close(x_grad, ref_x_grad, f"{model_type}: input-embedding grad")
    # every param grad: the converted blocks' through the mapping of Note [HF block mapping],
    # written out here independently of dtensor_moe.hf
    ours = {n: p.grad for n, p in model.named_parameters()}
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    for name in names:
        moe = model.get_submodule(name)
        for key, grad in _hf_block_grads(moe).items():
            close(grad, theirs.pop(f"{name}.{key}"), f"{model_type}: {name}.{key}.grad")
        ours = {n: g for n, g in ours.items() if not n.startswith(f"{name}.")}
    assert ours.keys() == theirs.keys()  # every HF param of the blocks was compared
    embeddings = [n for n in ours if n.endswith("embed_tokens.weight")]
    for n in embeddings:  # inputs_embeds bypass the table
        assert ours.pop(n) is None and theirs.pop(n) is None, n
    # The other params' grads, in float64: in fp32 some (linear attention's A_log and dt_bias)
    # come out of cancelling sums that magnify rounding to 5e-5 whether or not a block was
    # swapped; in float64 that noise is gone and any real difference would stand out.
    ref64 = copy.deepcopy(ref).double()
    ref64.set_experts_implementation("eager")  # HF's grouped_mm has no float64 kernel
    model64 = copy.deepcopy(ref64)
    hf.replace_moe_blocks(model64)
    for m in (ref64, model64):
        m.zero_grad(set_to_none=True)
        _forward_backward(m, ids)
    theirs64 = dict(ref64.named_parameters())
    for n, p in model64.named_parameters():
        if n not in ours:
            continue
        if p.grad is None or theirs64[n].grad is None:  # unused here (an indexer, a codec)
            assert p.grad is None and theirs64[n].grad is None, n
            continue
        close(p.grad, theirs64[n].grad, f"{model_type}: {n}.grad (float64)")


def _hf_block_grads(moe: MoE) -> dict[str, torch.Tensor]:
    """A converted layer's param grads under the HF block's param names."""
    ex, sh = moe.experts, moe.shared_experts
    grads = {
        "gate.weight": moe.router.gate.weight.grad,
        "experts.gate_up_proj": torch.cat([ex.w1.grad, ex.w3.grad], dim=1),
        "experts.down_proj": ex.w2.grad,
    }
    if sh is not None:
        mlp = moe.hf_source.shared
        grads[f"{mlp}.gate_proj.weight"] = sh.w1.weight.grad
        grads[f"{mlp}.up_proj.weight"] = sh.w3.weight.grad
        grads[f"{mlp}.down_proj.weight"] = sh.w2.weight.grad
        if sh.gate is not None:
            grads["shared_expert_gate.weight"] = sh.gate.weight.grad
    return grads


@pytest.mark.parametrize("model_type", ALL)
def test_state_dict_round_trip(model_type):
    ref = hf_model(model_type)
    model = copy.deepcopy(ref)
    hf.replace_moe_blocks(model)
    with torch.no_grad():  # train-like change, so the round trip is not of the initial weights
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    sd = hf.to_hf_state_dict(model)
    fresh = hf_model(model_type, seed=123)
    fresh.load_state_dict(sd, strict=True)
    assert sd.keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert sd[key].shape == value.shape and sd[key].dtype == value.dtype, key
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
        close(_output(fresh, inputs_embeds=fresh.get_input_embeddings()(ids)),
              _output(model, inputs_embeds=emb), f"{model_type}: reloaded outputs")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_correction_bias_is_the_expert_bias(model_type):
    ref = hf_model(model_type)
    block = ref.model.layers[1].mlp
    moe = hf.moe_from_hf(block)
    bias = block.gate.e_score_correction_bias
    assert moe.router.expert_bias.dtype == torch.float32
    assert torch.equal(moe.router.expert_bias, bias)
    cfg = ref.config
    assert moe.config.score_func == "sigmoid" and moe.config.use_expert_bias
    assert moe.config.route_scale == cfg.routed_scaling_factor
    assert (moe.config.num_expert_groups, moe.config.num_limited_groups) == (
        cfg.n_group, cfg.topk_group
    )
    assert moe.config.route_norm is cfg.norm_topk_prob
    assert moe.config.shared_hidden_total == cfg.n_shared_experts * cfg.moe_intermediate_size
    # the bias changes the choice: without it, some token picks other experts
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        picked = moe.router(x).topk_ids_TK.sort(-1).values
        moe.router.expert_bias.zero_()
        unbiased = moe.router(x).topk_ids_TK.sort(-1).values
    assert not torch.equal(picked, unbiased)


def test_settings_are_read_from_the_block():
    qwen2 = hf.moe_from_hf(hf_model("qwen2_moe").model.layers[0].mlp).config
    assert (qwen2.route_norm, qwen2.shared_expert_gate, qwen2.shared_hidden_total) == (
        False, True, 24
    )
    qwen3 = hf.moe_from_hf(hf_model("qwen3_moe").model.layers[0].mlp).config
    assert (qwen3.route_norm, qwen3.num_shared_experts, qwen3.hidden_dim) == (True, 0, 16)
    mixtral = hf.moe_from_hf(hf_model("mixtral").model.layers[0].mlp).config
    assert (mixtral.route_norm, mixtral.score_func, mixtral.hidden_dim) == (True, "softmax", 64)
    for model_type in FAMILIES:
        block = next(m for n, m in hf_model(model_type).named_modules() if n.endswith("mlp")
                     and hasattr(m, "experts"))
        cfg = hf.moe_from_hf(block).config
        assert (cfg.num_experts, cfg.top_k, cfg.aux_loss_coeff) == (8, 2, 0.0), model_type


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_caller_settings(model_type):
    """``moe_from_hf(block, **settings)`` and ``replace_moe_blocks(model, **settings)``: the
    block defines its shapes and routing; the caller picks the rest, checked before any swap."""
    model = hf_model(model_type)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    names = hf.replace_moe_blocks(model, fused_routed_step=False, recompute_experts=True)
    assert names
    for name in names:
        cfg = model.get_submodule(name).config
        assert (cfg.fused_routed_step, cfg.recompute_experts) == (False, True), name
    logits, emb_grad = _forward_backward(model, ids)
    logits_ref, emb_grad_ref = _forward_backward(ref, ids)
    close(logits, logits_ref, "logits")
    close(emb_grad, emb_grad_ref, "input-embedding grad")

    block = hf_model(model_type).get_submodule(names[0])
    default, plain = hf.moe_from_hf(block), hf.moe_from_hf(block, fused_routed_step=False)
    x = torch.randn(2, 5, default.config.dim, requires_grad=True)
    grads = []
    for moe in (default, plain):
        y = moe(x)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        grads.append((y.detach(), x.grad, moe.router.gate.weight.grad, moe.experts.w2.grad))
        x.grad = None
    assert torch.equal(grads[0][0], grads[1][0])  # the same output bits
    for a, b in zip(grads[0][1:], grads[1][1:]):  # gradients: the same up to float rounding
        close(a, b, "fused_routed_step=False against the default")
    assert hf.moe_from_hf(block, aux_loss_coeff=0.01).config.aux_loss_coeff == 0.01

    fresh = hf_model(model_type)
    with pytest.raises(ValueError, match=r"\['top_k'\] come from the HF block .* change the HF "
                       r"config"):
        hf.replace_moe_blocks(fresh, top_k=1)
    assert not any(isinstance(m, MoE) for m in fresh.modules())  # nothing swapped
    with pytest.raises(TypeError, match=r"unknown MoEConfig setting\(s\) \['fused'\]; the "
                       r"settings are \[.*'fused_routed_step'"):
        hf.moe_from_hf(block, fused=False)
    with pytest.raises(ValueError, match=r"capacity_factor"):  # MoEConfig's own check
        hf.moe_from_hf(block, capacity_factor=-1.0)


def test_meta_model_converts_without_allocating(monkeypatch):
    """Note [Meta-device init]: a block on ``meta`` gives a layer on ``meta``, made there. Its
    experts here would take 3 TiB as float32 on the CPU, which no test machine has."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=16384, moe_intermediate_size=16384, num_experts=1024,
                            num_experts_per_tok=8, norm_topk_prob=True)
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    with monkeypatch.context() as m:
        _refuse_global_defaults(m)
        moe = hf.moe_from_hf(block)
    assert all(t.is_meta for t in [*moe.parameters(), *moe.buffers()])
    assert moe.experts.w1.shape == (1024, 16384, 16384) and moe.experts.w1.dtype == torch.bfloat16

    model = hf_model("deepseek_v3")  # a whole model: built on meta, swapped, materialised
    with torch.device("meta"):
        meta_model = type(model)(model.config)
    names = hf.replace_moe_blocks(meta_model)
    meta_model.to_empty(device="cpu")
    swapped = copy.deepcopy(model)
    hf.replace_moe_blocks(swapped)
    meta_model.load_state_dict(swapped.state_dict(), strict=True)
    persistent = swapped.state_dict().keys()
    with torch.no_grad():  # HF's own non-persistent buffers (rotary inv_freq) are HF's to set
        for name, buf in swapped.named_buffers():
            if name not in persistent and ".router." not in name:
                meta_model.get_buffer(name).copy_(buf)
    for name in names:  # ours: not in a checkpoint (Note [Meta-device init])
        router = meta_model.get_submodule(name).router
        router.tokens_per_expert.fill_(7)  # what uninitialised memory may hold
        router.reset_counters()
        assert not router.tokens_per_expert.any()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, _ = _forward_backward(meta_model, ids)
    logits_ref, _ = _forward_backward(model, ids)
    close(logits, logits_ref, "logits")


def test_compiled_decoder_layers():
    """Each decoder layer of a swapped HF model under ``torch.compile`` (per layer,
    ``fullgraph=False``): the same logits and gradients as eager, and no graph break but the
    router counter's in training (Note [MoE under torch.compile] in ``moe/layer.py``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = hf_model("qwen3_moe")
    hf.replace_moe_blocks(model)
    eager = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    logits, emb_grad = _forward_backward(model, ids)
    logits_ref, emb_grad_ref = _forward_backward(eager, ids)
    close(logits, logits_ref, "logits")
    close(emb_grad, emb_grad_ref, "input-embedding grad")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if q.grad is None:  # the input embedding: the inputs are embeddings here
            assert p.grad is None, name
        else:
            close(p.grad, q.grad, name)
    reasons = list(counters["graph_break"])
    assert reasons and all("count_unless_recompute" in r for r in reasons), reasons


def _refuse_global_defaults(monkeypatch) -> None:
    """The conversion builds with factory arguments (device=, dtype=): it must not change
    torch's process-wide default dtype or device, which other threads would see."""
    def refuse(*_args):
        raise AssertionError("moe_from_hf must not change torch's process-wide defaults")

    monkeypatch.setattr(torch, "set_default_dtype", refuse)
    monkeypatch.setattr(torch, "set_default_device", refuse)


def test_dtype_device_mode_and_no_shared_storage(monkeypatch):
    block = hf_model("qwen2_moe").model.layers[0].mlp.to(torch.float64).eval()
    blocks = {dtype: hf_model("deepseek_v3").model.layers[1].mlp.to(dtype)
              for dtype in (torch.bfloat16, torch.float8_e4m3fn)}
    _refuse_global_defaults(monkeypatch)
    moe = hf.moe_from_hf(block)
    assert not moe.training
    assert all(p.dtype == torch.float64 for p in moe.parameters())
    with torch.no_grad():
        block.experts.gate_up_proj.zero_()
    assert moe.experts.w1.abs().sum() > 0
    for dtype, block in blocks.items():  # float8: made in float32, then cast
        moe = hf.moe_from_hf(block)
        assert {p.dtype for p in moe.parameters()} == {dtype}, dtype
        assert moe.router.expert_bias.dtype == torch.float32
        assert moe.router.tokens_per_expert.dtype == torch.int64
        assert torch.equal(moe.experts.w2.float(), block.experts.down_proj.float())


def test_unsupported_blocks_and_settings():
    supported = r"supported: MixtralSparseMoeBlock \(Mixtral\), Qwen2MoeSparseMoeBlock"
    with pytest.raises(TypeError, match=r"torch\.nn\.modules\.linear\.Linear is not a "
                       r"supported MoE block; " + supported):
        hf.moe_from_hf(nn.Linear(2, 2))

    class OtherMoeBlock(nn.Module):  # an MoE family we do not convert
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    model = hf_model("qwen3_moe")
    model.model.layers[1].mlp = OtherMoeBlock()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=r"test_hf\.[\w.<>]*OtherMoeBlock is not a supported"):
        hf.replace_moe_blocks(model)
    assert isinstance(model.model.layers[0].mlp, type(hf_model("qwen3_moe").model.layers[0].mlp))
    assert model.state_dict().keys() == before.keys()  # nothing swapped

    jetmoe = _jetmoe_model()  # experts in input_linear/output_linear, no `experts` child
    with pytest.raises(TypeError, match=r"JetMoeMoE is not a supported MoE block; " + supported):
        hf.replace_moe_blocks(jetmoe)

    with pytest.raises(ValueError, match=r"router jitter \(router_jitter_noise=0\.1\) in "
                       r"training.*set config\.router_jitter_noise = 0"):
        hf.replace_moe_blocks(hf_model("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match=r"expert activation GELUActivation.*only SwiGLU"):
        hf.moe_from_hf(hf_model("qwen3_moe", hidden_act="gelu").model.layers[0].mlp)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*set "
                       r"model\.config\.output_router_logits = False"):
        hf.replace_moe_blocks(hf_model("olmoe", output_router_logits=True))
    with pytest.raises(ValueError, match=r"holds no supported MoE block"):
        hf.replace_moe_blocks(nn.Sequential(nn.Linear(2, 2)))
    plain = nn.Sequential(MoE(hf.moe_from_hf(hf_model("olmoe").model.layers[0].mlp).config))
    with pytest.raises(ValueError, match=r"the MoE at '0' was not made by moe_from_hf"):
        hf.to_hf_state_dict(plain)


def _jetmoe_model() -> nn.Module:
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_key_value_heads=2, kv_channels=8,
        intermediate_size=32, max_position_embeddings=32, num_local_experts=4,
        num_experts_per_tok=2,
    )
    return JetMoeForCausalLM(config)


def test_config_class_builds_tiny_models_without_network():
    # The fixtures build from config classes only: no hub access is attempted.
    for model_type in FAMILIES:
        assert hf_config(model_type).model_type == model_type


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, **env},
    )


@pytest.fixture(scope="module")
def import_run() -> subprocess.CompletedProcess:
    """One fresh interpreter for the two import tests below (an interpreter start with torch is
    most of their time): ``import dtensor_moe``, whether that imported transformers, then
    transformers made unimportable, as on a venv without the hf extra (which changes nothing
    that is already imported, as dtensor_moe did not import it), and ``from dtensor_moe import
    hf``'s error."""
    return _python(
        "import sys, dtensor_moe\n"
        "print('transformers' in sys.modules)\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    from dtensor_moe import hf\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )


def test_import_dtensor_moe_does_not_import_transformers(import_run):
    run = import_run
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].strip() == "False", run.stdout


def test_missing_extra_says_how_to_install(import_run):
    # transformers made unimportable, as on a venv without the hf extra
    run = import_run
    assert run.returncode == 0, run.stderr
    assert 'pip install -e ".[hf]" in a checkout' in run.stdout, run.stdout


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral"])
def test_bf16_model_routes_like_hf(model_type):
    # HF keeps DeepSeek-V3's and GLM4-MoE's gate weight and correction bias in float32 in a bf16
    # model and routes in float32; the converted layer keeps those dtypes and routes the same.
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(hf_config(model_type), dtype=torch.bfloat16)
    with torch.no_grad():
        for src, dst in zip(hf_model(model_type).parameters(), ref.parameters()):
            dst.copy_(src)  # the decisive fp32 weights of hf_model, in HF's bf16 layout
        for src, dst in zip(hf_model(model_type).buffers(), ref.buffers()):
            dst.copy_(src)
    model = copy.deepcopy(ref)
    names = hf.replace_moe_blocks(model)
    for name in names:
        block, moe = ref.get_submodule(name), model.get_submodule(name)
        assert moe.router.gate.weight.dtype == block.gate.weight.dtype
        assert moe.experts.w1.dtype == torch.bfloat16
        if moe.router.expert_bias is not None:
            assert moe.router.expert_bias.dtype == torch.float32
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
        with torch.no_grad():
            _, hf_weights, hf_ids = block.gate(x)
            routing = moe.router(x)
        assert torch.equal(routing.topk_ids_TK.sort(-1).values, hf_ids.sort(-1).values), name
        order_ours, order_hf = routing.topk_ids_TK.argsort(-1), hf_ids.argsort(-1)
        torch.testing.assert_close(
            routing.topk_scores_TK.gather(-1, order_ours).float(),
            hf_weights.gather(-1, order_hf).float(), rtol=1e-2, atol=1e-2,
        )
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("model_type", ALL)
def test_router_dtype_follows_the_hf_router(model_type):
    """``router_dtype`` is float32 exactly for the families whose HF router computes its
    logits from ``x.float()`` / ``x.type(torch.float32)``, read from the router's source."""
    import inspect

    ref = hf_model(model_type)
    for name in _blocks(ref):
        block = ref.get_submodule(name)
        source = inspect.getsource(type(block.gate).forward)
        line = next(ln for ln in source.splitlines() if "router_logits = F.linear(" in ln)
        in_float32 = ".float()" in line or "torch.float32" in line
        want = torch.float32 if in_float32 else None
        assert hf.moe_from_hf(block).config.router_dtype is want, (model_type, line)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_bf16_cast_routes_like_hf(model_type):
    """Converted in float32, then both cast with ``.to(torch.bfloat16)``: the same experts for
    every one of 4,096 tokens and outputs within bf16 rounding. HF's cast rounds its correction
    bias to bf16 while ours keeps float32 values (Note [Expert bias keeps its dtype]), so ours
    gets HF's rounded values; without ``router_dtype`` bf16 logits pick other experts."""
    ref = hf_model(model_type)
    (name,) = _blocks(ref)
    block = ref.get_submodule(name)
    moe, plain = hf.moe_from_hf(block), hf.moe_from_hf(block, router_dtype=None)
    for module in (block, moe, plain):
        module.to(torch.bfloat16)
    with torch.no_grad():
        for ours in (moe, plain):
            ours.router.expert_bias.copy_(block.gate.e_score_correction_bias)
    x = torch.randn(1, 4096, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        _, _, hf_ids = block.gate(x)
        ids, plain_ids = moe.router(x[0]).topk_ids_TK, plain.router(x[0]).topk_ids_TK
        want, got = block(x).float(), moe(x).float()
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    assert not torch.equal(plain_ids.sort(-1).values, hf_ids.sort(-1).values)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
