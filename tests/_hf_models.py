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


def hf_config(model_type: str, **overrides):
    import transformers

    fields = {**COMMON, **FAMILIES[model_type], **overrides}
    return transformers.AutoConfig.for_model(model_type, **fields)


@torch.no_grad()
def hf_model(model_type: str, seed: int = 0, **overrides):
    """A tiny random HF causal LM of ``model_type`` in fp32, with decisive routing.

    The router weights are scaled up so that top-k choices are far from ties (parity with a
    model that sums in another order then never flips a choice), and DeepSeek-style correction
    biases get random values, so that they change which experts are picked.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides)).float()
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "weight"):
            module.weight.normal_(0, 0.5)
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.1)
    return model
