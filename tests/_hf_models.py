"""Tiny random Hugging Face MoE models, built from their config classes (no download).

Used by ``tests/test_hf.py`` (``docs/examples/hf_moe_parallel.py`` carries its own copy of the
Qwen3-MoE and DeepSeek-V3 settings, so that it runs without the tests). Every config has 2 layers with at least one MoE block, 8 experts and top-2 (DeepSeek-style routers with 4
groups of which a token may use 2, or 2 of which it may use 1), fp32.
"""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

# model_type -> the family's own settings (the MoE ones read from the block by dtensor_moe.hf)
FAMILIES: dict[str, dict] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], head_dim=8,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "deepseek_v3": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
    ),
    "glm4_moe": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, head_dim=8,
    ),
}


# Families beyond the six above: key -> (transformers model package, config class, model class,
# settings). Some are text models of multimodal families (built from their text config class);
# the shorthands are shared settings of Qwen2-MoE-like, DeepSeek-V3-like, multi-head latent
# attention and linear-attention families.
_Q2 = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)
_DS = dict(num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2,
           routed_scaling_factor=2.5, norm_topk_prob=True)
_MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8)
_LIN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4)
_HYBRID = ["linear_attention", "full_attention"]
_KIMI = dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
             num_shared_experts=1, num_expert_group=4, topk_group=2, moe_renormalize=True,
             mlp_layer_types=["dense", "sparse"], layer_types=_HYBRID, linear_head_dim=8,
             linear_num_heads=4, head_dim=8, pad_token_id=0, **_MLA)
_INDEXED = dict(index_topk=4, index_head_dim=8, index_n_heads=2, num_key_value_heads=4,
                **dict(_MLA, q_lora_rank=8))

EXTRA: dict[str, tuple[str, str, str, dict]] = {
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _Q2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8,
        layer_types=_HYBRID, **_LIN)),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        _Q2, head_dim=8, layer_types=_HYBRID, **_LIN)),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
        mlp_only_layers=[], head_dim=8)),
    "qwen3_omni_thinker": ("qwen3_omni_moe", "Qwen3OmniMoeTextConfig",
                           "Qwen3OmniMoeThinkerTextModel", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], head_dim=8)),
    "qwen3_omni_talker": ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig",
                          "Qwen3OmniMoeTalkerModel", dict(
        _Q2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8)),
    "qwen4_exp": ("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(
        _Q2, norm_topk_prob=True, head_dim=8, layer_types=_HYBRID, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2,
        hc_lowrank=8, ple_embed_dim=16, heads_per_ngram=2, **_LIN)),
    "minimax": ("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, head_dim=8,
        layer_types=["full_attention", "linear_attention"])),
    "flex_olmo": ("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0)),
    "mellum": ("mellum", "MellumConfig", "MellumForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=False, head_dim=8, layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["sparse", "sparse"], sliding_window=4)),
    "lara_mini": ("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", dict(
        _Q2, norm_topk_prob=True, head_dim=8, layer_types=_HYBRID, sliding_window=4, **_LIN)),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1, **_INDEXED)),
    "dots1": ("dots1", "Dots1Config", "Dots1ForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, head_dim=8)),
    "dots3_note": ("dots3_note", "Dots3NoteTextConfig", "Dots3NoteForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=1, shared_experts_intermediate_size=24,
        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention",
        "sliding_attention"], sliding_window=4, head_dim=8, pad_token_id=0, **_INDEXED)),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse"], **_MLA)),
    "glm4v_moe": ("glm4v_moe", "Glm4vMoeTextConfig", "Glm4vMoeTextModel", dict(
        _DS, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.5})),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1, layer_types=["indexed_attention"] * 2,
        indexer_types=["full", "full"], **_INDEXED)),
    "exaone_moe": ("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        _DS, num_experts=8, num_shared_experts=2, mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, head_dim=8)),
    "kimi_linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", dict(
        _KIMI, routed_scaling_factor=2.446)),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", dict(
        _KIMI, routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=0,
        layer_group_size=2)),
    "solar_open": ("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=2, head_dim=8)),
    "mimo_v2_flash": ("mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        _DS, n_routed_experts=8, head_dim=8, v_head_dim=8,
        layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
        sliding_window=4)),
    "sarvam_moe": ("glm4_moe", "SarvamMoEConfig", "Glm4MoeForCausalLM", dict(
        _DS, n_routed_experts=8, n_shared_experts=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, head_dim=8)),
}
_CONFIG_MODULES = {"sarvam_moe": "sarvam_moe"}  # a config of its own for GLM4-MoE's model

ALL = [*FAMILIES, *EXTRA]  # every key hf_model accepts


def hf_config(key: str, **overrides):
    import importlib

    import transformers

    if key in FAMILIES:
        fields = {**COMMON, **FAMILIES[key], **overrides}
        return transformers.AutoConfig.for_model(key, **fields)
    package, config_class, _, settings = EXTRA[key]
    package = _CONFIG_MODULES.get(key, package)
    module = importlib.import_module(f"transformers.models.{package}.configuration_{package}")
    return getattr(module, config_class)(**{**COMMON, **settings, **overrides})


@torch.no_grad()
def hf_model(key: str, seed: int = 0, **overrides):
    """A tiny random HF model of family ``key`` in fp32, with decisive routing.

    The router weights are scaled up so that top-k choices are far from ties (parity with a
    model that sums in another order then never flips a choice), DeepSeek-style correction
    biases get random values, so that they change which experts are picked, and the routed
    experts are redrawn (some HF classes leave them uninitialised).
    """
    import importlib

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(key, **overrides)
    if key in FAMILIES:
        model = AutoModelForCausalLM.from_config(config)
    else:
        package, _, model_class, _ = EXTRA[key]
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        model = getattr(module, model_class)._from_config(config)
    model = model.float()
    for name, module in model.named_modules():
        gate_up = getattr(getattr(module, "experts", None), "gate_up_proj", None)
        if isinstance(gate_up, torch.Tensor) and hasattr(getattr(module, "gate", None), "weight"):
            module.gate.weight.normal_(0, 0.5)
            gate_up.normal_(0, 0.1)
            module.experts.down_proj.normal_(0, 0.1)
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.1)
    return model
