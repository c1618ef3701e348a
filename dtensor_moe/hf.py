"""Hugging Face ``transformers`` MoE blocks as :class:`dtensor_moe.MoE` layers, and back.

::

    from dtensor_moe import hf
    ours = hf.moe_from_hf(block)           # one HF MoE block -> MoE, same weights and math
    names = hf.replace_moe_blocks(model)   # swap every supported block in place
    sd = hf.to_hf_state_dict(model)        # HF keys and layouts, loadable with strict=True

Needs the ``hf`` extra (``pip install -e ".[hf]"`` from a checkout of this repository); ``import dtensor_moe`` never
imports this module. ``docs/hf.md`` lists the families, the weight mapping and the limits.

Note [HF block mapping]
~~~~~~~~~~~~~~~~~~~~~~~
Every supported family (transformers 5.x) has the same routed part: a router ``gate`` whose
``weight`` is ``(E, D)`` and experts whose ``gate_up_proj`` is ``(E, 2H, D)`` (the gate
projection's ``H`` rows first, then the up projection's) and ``down_proj`` ``(E, D, H)``, with
``act(gate) * up``. Our ``experts.w1`` is the first half of ``gate_up_proj``, ``w3`` the second
and ``w2`` is ``down_proj``; ``router.gate.weight`` is the router's ``weight``. The families
differ only in routing and shared experts, and each setting is read from the block (its router
holds ``top_k``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``, ``topk_group``):

=============  ===========================  ================================================
family         routing                      shared experts
=============  ===========================  ================================================
Mixtral        softmax, top-k, renormalised none
               (always, in MixtralTopKRouter)
Qwen2-MoE      softmax, top-k,              ``shared_expert`` (an MLP) scaled by
               ``norm_topk_prob``           ``sigmoid(shared_expert_gate(x))``
Qwen3-MoE      softmax, top-k,              none
               ``norm_topk_prob``
OLMoE          softmax, top-k,              none
               ``norm_topk_prob``
DeepSeek-V3    sigmoid; the correction bias ``shared_experts`` (one MLP of
GLM4-MoE       picks the experts (group-    ``n_shared_experts * moe_intermediate_size``)
               limited: top-2 sum per
               group) but not the weights;
               ``norm_topk_prob``, then
               ``routed_scaling_factor``
=============  ===========================  ================================================

The DeepSeek-V3-style routers (and Lara-Mini's softmax router) compute their logits as
``F.linear(x.float(), weight.float())`` whatever the model's dtype; their layers get
``router_dtype=torch.float32``, so a bf16 model (after ``model.to(torch.bfloat16)``, or under
FSDP2 bf16 mixed precision) routes as HF's does. The other routers compute in the gate weight's
dtype: ``router_dtype=None``. A caller may set ``router_dtype`` (for example float32 routing
for a softmax family trained in bf16); the routing then differs from HF's in bf16.

The other families of ``_FAMILIES`` (Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3.2, Kimi-Linear, ...;
``docs/hf.md`` lists them) follow one of these two routing patterns, with or without a shared
MLP and its sigmoid gate. A family is matched by its block's exact class, by module and class
name, so that looking does not import every transformers model.

The shared MLP's ``gate_proj``/``up_proj``/``down_proj`` become ``shared_experts.w1``/``w3``/
``w2`` (one fused shared expert: ``num_shared_experts=1`` with the MLP's whole hidden width),
Qwen2-MoE's ``shared_expert_gate`` becomes ``shared_experts.gate``
(``MoEConfig.shared_expert_gate``), and the DeepSeek-style ``e_score_correction_bias`` becomes
``router.expert_bias`` (``use_expert_bias=True``). The auxiliary loss is off
(``aux_loss_coeff=0``): HF computes its own from recorded router logits, which a swapped block
no longer produces, so :func:`replace_moe_blocks` refuses ``output_router_logits=True``.

Each converted layer remembers where it came from in ``moe.hf_source`` (an :class:`HFSource`),
which :func:`to_hf_state_dict` uses to write the HF keys back.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

try:
    import transformers  # noqa: F401  (the extra this module needs)
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "dtensor_moe.hf needs the Hugging Face transformers library, which is an optional "
        'extra: run pip install -e ".[hf]" in a checkout of the dtensor_moe repository (the '
        "package is not on a package index), or pip install 'transformers>=5,<6'"
    ) from error

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.moe.config import FACTORY_DTYPES, MoEConfig
from dtensor_moe.moe.layer import MoE

__all__ = [
    "HF_DEFINED_FIELDS",
    "SUPPORTED_BLOCKS",
    "HFSource",
    "moe_from_hf",
    "replace_moe_blocks",
    "to_hf_state_dict",
]


@dataclass(frozen=True)
class _Family:
    """How one transformers family's MoE block maps to :class:`MoE` (Note [HF block mapping])."""

    name: str
    module: str  # the transformers modeling module
    block: str  # the sparse MoE block class in it
    grouped_sigmoid: bool  # DeepSeek-V3-style router (sigmoid, bias, groups, scaling)
    shared: str | None  # attribute of the shared MLP on the block
    shared_gate: str | None  # attribute of the shared MLP's sigmoid gate (Qwen2-MoE)
    always_normalised: bool = False  # Mixtral's router renormalises without a flag
    float32_router: bool = False  # the HF router computes its logits in float32

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is exactly this family's block class (no subclass): compared by
        module and class name, so no transformers model module is imported to find out."""
        cls = type(module)
        if cls.__module__ != self.module or cls.__qualname__ != self.block:
            return False
        return getattr(sys.modules.get(self.module), self.block, None) is cls


def _softmax(name: str, model: str, block: str, *, shared: str | None = None,
             shared_gate: str | None = None, always_normalised: bool = False,
             float32_router: bool = False) -> _Family:
    """A family routed like Mixtral/Qwen: softmax, top-k, renormalised per ``norm_topk_prob``
    (or always, for routers without that flag); logits in the gate weight's dtype, or in
    float32 with ``float32_router``."""
    return _Family(name, f"transformers.models.{model}.modeling_{model}", block,
                   grouped_sigmoid=False, shared=shared, shared_gate=shared_gate,
                   always_normalised=always_normalised, float32_router=float32_router)


def _sigmoid(name: str, model: str, block: str, *, shared: str | None = "shared_experts"
             ) -> _Family:
    """A family routed like DeepSeek-V3: sigmoid, correction bias, group-limited, scaled, with
    the logits computed in float32 (``F.linear(x.float(), weight.float())`` in HF)."""
    return _Family(name, f"transformers.models.{model}.modeling_{model}", block,
                   grouped_sigmoid=True, shared=shared, shared_gate=None, float32_router=True)


# Every family here is checked by tests/test_hf.py on a tiny random model (transformers 5.24).
_FAMILIES = (
    _softmax("Mixtral", "mixtral", "MixtralSparseMoeBlock", always_normalised=True),
    _softmax("Qwen2-MoE", "qwen2_moe", "Qwen2MoeSparseMoeBlock", shared="shared_expert",
             shared_gate="shared_expert_gate"),
    _softmax("Qwen3-MoE", "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    _softmax("OLMoE", "olmoe", "OlmoeSparseMoeBlock"),
    _sigmoid("DeepSeek-V3", "deepseek_v3", "DeepseekV3MoE"),
    _sigmoid("GLM4-MoE", "glm4_moe", "Glm4MoeMoE"),  # also Sarvam-MoE, which reuses it
    _softmax("Qwen3-Next", "qwen3_next", "Qwen3NextSparseMoeBlock", shared="shared_expert",
             shared_gate="shared_expert_gate"),
    _softmax("Qwen3.5-MoE", "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", shared="shared_expert",
             shared_gate="shared_expert_gate", always_normalised=True),
    _softmax("Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
             always_normalised=True),
    _softmax("Qwen3-Omni-MoE thinker", "qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock"),
    _softmax("Qwen3-Omni-MoE talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextSparseMoeBlock",
             shared="shared_expert", shared_gate="shared_expert_gate"),
    _softmax("Qwen4-Exp", "qwen4_exp", "Qwen4ExpTextSparseMoeBlock", shared="shared_expert",
             shared_gate="shared_expert_gate"),
    _softmax("MiniMax", "minimax", "MiniMaxSparseMoeBlock", always_normalised=True),
    _softmax("FlexOlmo", "flex_olmo", "FlexOlmoSparseMoeBlock"),
    _softmax("Mellum", "mellum", "MellumSparseMoeBlock"),
    _softmax("Lara-Mini", "lara_mini", "LaraMiniSparseMoeBlock", shared="shared_expert",
             float32_router=True),
    _sigmoid("DeepSeek-V3.2", "deepseek_v32", "DeepseekV32MoE"),
    _sigmoid("dots1", "dots1", "Dots1MoE"),
    _sigmoid("dots3-note", "dots3_note", "Dots3NoteTextMoE"),
    _sigmoid("GLM4-MoE-Lite", "glm4_moe_lite", "Glm4MoeLiteMoE"),
    _sigmoid("GLM4V-MoE", "glm4v_moe", "Glm4vMoeTextMoE"),
    _sigmoid("GLM-MoE-DSA", "glm_moe_dsa", "GlmMoeDsaMoE"),
    _sigmoid("EXAONE-MoE", "exaone_moe", "ExaoneMoeSparseMoEBlock"),
    _sigmoid("Kimi-Linear", "kimi_linear", "KimiLinearMoE"),
    _sigmoid("Bailing-Hybrid", "bailing_hybrid", "BailingHybridMoE"),
    _sigmoid("Solar-Open", "solar_open", "SolarOpenMoE"),
    _sigmoid("MiMo-V2-Flash", "mimo_v2_flash", "MiMoV2FlashMoE", shared=None),
)

#: Supported block class names, by family.
SUPPORTED_BLOCKS: dict[str, str] = {f.name: f.block for f in _FAMILIES}


@dataclass(frozen=True)
class HFSource:
    """Where a converted :class:`MoE` came from: the family, the block class, and the HF
    attribute names of its shared MLP and shared gate (``None`` when the family has none)."""

    family: str
    block_class: str
    shared: str | None
    shared_gate: str | None


def _family_of(block: nn.Module) -> _Family:
    for family in _FAMILIES:
        if family.matches(block):
            return family
    supported = ", ".join(f"{f.block} ({f.name})" for f in _FAMILIES)
    raise TypeError(
        f"dtensor_moe.hf: {type(block).__module__}.{type(block).__qualname__} is not a "
        f"supported MoE block; supported: {supported}. Other families (for example ones whose "
        "experts are not SwiGLU, or that do not route token-choice top-k) are not converted"
    )


def _is_silu(act: object) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _unsupported(family: _Family, what: str, fix: str) -> ValueError:
    return ValueError(f"dtensor_moe.hf: this {family.name} block {what}, which MoE does not "
                      f"support; {fix}")


def _check_block(family: _Family, block: nn.Module) -> None:
    """Refuse every setting that MoE would compute differently (nothing is guessed)."""
    experts = block.experts
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(experts, attr, None), torch.Tensor):
            raise _unsupported(family, f"has experts without a fused {attr} tensor",
                               "use a transformers 5.x model (fused 3-D expert weights)")
    if getattr(experts, "gate_up_proj_bias", None) is not None or getattr(
        experts, "down_proj_bias", None
    ) is not None:
        raise _unsupported(family, "has expert biases", "convert a model without them")
    if not _is_silu(getattr(experts, "act_fn", None)):
        raise _unsupported(
            family, f"uses the expert activation {type(experts.act_fn).__name__}",
            "only SwiGLU experts (hidden_act='silu') are supported",
        )
    if family.shared is not None:
        mlp = getattr(block, family.shared)
        if not _is_silu(getattr(mlp, "act_fn", None)):
            raise _unsupported(
                family, f"uses the shared-expert activation {type(mlp.act_fn).__name__}",
                "only SwiGLU shared experts (hidden_act='silu') are supported",
            )
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if lin.bias is not None:
                raise _unsupported(family, "has shared-expert biases",
                                   "convert a model without them")
    if family.shared_gate is not None and getattr(block, family.shared_gate).bias is not None:
        raise _unsupported(family, "has a biased shared-expert gate", "convert one without")
    jitter = getattr(block, "jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise _unsupported(
            family, f"uses router jitter (router_jitter_noise={jitter}) in training",
            "set config.router_jitter_noise = 0 before building the model",
        )


def _config_of(family: _Family, block: nn.Module) -> MoEConfig:
    router, experts = block.gate, block.experts
    num_experts, dim = router.weight.shape
    hidden = experts.down_proj.shape[-1]
    if tuple(experts.gate_up_proj.shape) != (num_experts, 2 * hidden, dim):
        raise _unsupported(
            family, f"has gate_up_proj of shape {tuple(experts.gate_up_proj.shape)}, not "
            f"(E, 2H, D) = {(num_experts, 2 * hidden, dim)}", "check the checkpoint")
    fields: dict = dict(dim=dim, hidden_dim=hidden, num_experts=num_experts, top_k=router.top_k)
    if family.float32_router:
        fields["router_dtype"] = torch.float32
    if family.always_normalised:
        fields["route_norm"] = True
    elif isinstance(getattr(router, "norm_topk_prob", None), bool):
        fields["route_norm"] = router.norm_topk_prob
    else:
        raise _unsupported(family, f"has a router ({type(router).__name__}) without a boolean "
                           "norm_topk_prob", "check the transformers version (5.x)")
    if family.grouped_sigmoid:
        fields.update(
            score_func="sigmoid",
            use_expert_bias=True,
            route_scale=float(router.routed_scaling_factor),
            num_expert_groups=int(router.num_group),
            num_limited_groups=int(router.topk_group),
        )
    if family.shared is not None:
        mlp = getattr(block, family.shared)
        fields.update(
            num_shared_experts=1,
            shared_hidden_dim=mlp.gate_proj.out_features,
            shared_expert_gate=family.shared_gate is not None,
        )
    return MoEConfig(**fields)


# The MoEConfig fields that HF's block defines (its shapes and its routing math): read from the
# block, never set by the caller. Every other field (the compute path, fused_routed_step,
# recompute_experts, router losses, capacity) is the caller's choice.
HF_DEFINED_FIELDS = frozenset({
    "dim", "hidden_dim", "num_experts", "top_k", "score_func", "route_norm", "route_scale",
    "num_expert_groups", "num_limited_groups", "score_before_experts", "use_expert_bias",
    "num_shared_experts", "shared_hidden_dim", "shared_expert_gate",
})


def _with_settings(config: MoEConfig, settings: dict) -> MoEConfig:
    """``config`` with the caller's ``settings`` (checked: known, not defined by the block)."""
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(
            f"dtensor_moe.hf: unknown MoEConfig setting(s) {unknown}; the settings are "
            f"{sorted(names - HF_DEFINED_FIELDS)}"
        )
    fixed = sorted(set(settings) & HF_DEFINED_FIELDS)
    if fixed:
        raise ValueError(
            f"dtensor_moe.hf: {fixed} come from the HF block (its shapes and routing) and cannot "
            "be set; change the HF config before building the model instead"
        )
    return dataclasses.replace(config, **settings) if settings else config


@torch.no_grad()
def moe_from_hf(block: nn.Module, **settings: Any) -> MoE:
    """One HF sparse MoE block as a :class:`MoE` with the same weights and math.

    ``settings`` are :class:`MoEConfig` fields for the new layer that the block does not define,
    for example ``fused_routed_step=False`` (faster, more activation memory),
    ``recompute_experts=True``, ``aux_loss_coeff`` or ``capacity_factor`` (which drops tokens,
    so the output is then no longer HF's). The fields the block defines
    (:data:`HF_DEFINED_FIELDS`) are read from it.

    The new layer is made on the experts' device and in their dtype (float8: in float32, then
    cast), so a block on the ``meta`` device converts in no time and allocates nothing (build a
    large model on ``meta``, convert, parallelize, then ``to_empty`` and load). No global
    default of torch changes. It has the block's training mode; the router
    gate keeps the HF gate's dtype and the correction bias stays float32. The families whose HF
    router computes its logits in float32 (DeepSeek-V3 style, Lara-Mini) get
    ``router_dtype=torch.float32``, so the layer routes in float32 as HF's does, also after a
    cast to bf16 (Note [HF block mapping]). It shares no storage with the block. Its
    ``hf_source`` records the family (used by :func:`to_hf_state_dict`).

    Raises:
        TypeError: ``block`` is not one of :data:`SUPPORTED_BLOCKS`, or a setting is not a
            :class:`MoEConfig` field.
        ValueError: the block uses a setting that :class:`MoE` does not compute (router jitter,
            an activation other than SiLU, biases); the message names it and the fix. Also a
            setting of :data:`HF_DEFINED_FIELDS`, or a value :class:`MoEConfig` refuses.
    """
    family = _family_of(block)
    _check_block(family, block)
    config = _with_settings(_config_of(family, block), settings)
    gate_up = block.experts.gate_up_proj
    # Made where and as the block's experts are: no copy, none on the CPU. A storage dtype the
    # init cannot draw in (float8) is made in float32 there and cast.
    storage = gate_up.dtype not in FACTORY_DTYPES
    moe = MoE(config, device=gate_up.device, dtype=torch.float32 if storage else gate_up.dtype)
    if storage:
        moe.to(gate_up.dtype)
    H = config.hidden_dim
    # The router keeps HF's gate dtype; router_dtype (set above for the float32 routers) says
    # in which dtype the logits are computed, whatever the gate's dtype becomes.
    weight = block.gate.weight
    moe.router.gate.weight = nn.Parameter(weight.detach().clone(), weight.requires_grad)
    moe.experts.w1.copy_(gate_up[:, :H])
    moe.experts.w3.copy_(gate_up[:, H:])
    moe.experts.w2.copy_(block.experts.down_proj)
    if family.grouped_sigmoid:
        # HF keeps the correction bias in float32 whatever the model's dtype; so do we.
        moe.router.expert_bias = block.gate.e_score_correction_bias.detach().float().clone()
    if family.shared is not None:
        mlp, shared = getattr(block, family.shared), moe.shared_experts
        shared.w1.weight.copy_(mlp.gate_proj.weight)
        shared.w3.weight.copy_(mlp.up_proj.weight)
        shared.w2.weight.copy_(mlp.down_proj.weight)
        if family.shared_gate is not None:
            shared.gate.weight.copy_(getattr(block, family.shared_gate).weight)
    moe.hf_source = HFSource(
        family=family.name,
        block_class=family.block,
        shared=family.shared,
        shared_gate=family.shared_gate,
    )
    moe.train(block.training)
    return moe


def _looks_like_moe_block(module: nn.Module) -> bool:
    """A block of an MoE family we do not convert: a router (``gate`` or ``router`` child)
    beside routed experts, held in an ``experts`` child or, as in JetMoE's ``JetMoeMoE``
    (``input_linear``/``output_linear``), by a block whose class name says MoE."""
    children = dict(module.named_children())
    if "gate" not in children and "router" not in children:
        return False
    return "experts" in children or "moe" in type(module).__name__.lower()


def replace_moe_blocks(model: nn.Module, **settings: Any) -> list[str]:
    """Swap every supported HF MoE block of ``model`` for :func:`moe_from_hf` of it (with the
    same ``settings`` for every block), in place.

    Returns the qualified names of the swapped modules (for example
    ``"model.layers.0.mlp"``), in ``named_modules`` order.

    Checks everything before swapping anything, so a failure leaves ``model`` unchanged.

    Raises:
        ValueError: ``model.config.output_router_logits`` is set (HF's auxiliary loss reads the
            router logits of HF's router classes; use ``MoEConfig.aux_loss_coeff`` or the expert
            bias instead), ``model`` holds no supported block, or a block has an unsupported
            setting (see :func:`moe_from_hf`).
        TypeError: ``model`` holds an MoE block of an unsupported family.
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else None
    if any(getattr(c, "output_router_logits", False) for c in (config, text_config)):
        raise ValueError(
            "dtensor_moe.hf.replace_moe_blocks: the model has output_router_logits=True, whose "
            "auxiliary loss reads the logits of HF's own router modules and would silently "
            "vanish after the swap; set model.config.output_router_logits = False (and use "
            "MoEConfig.aux_loss_coeff or the expert bias for load balancing)"
        )
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            continue
        if _looks_like_moe_block(module) or any(f.matches(module) for f in _FAMILIES):
            family = _family_of(module)  # TypeError for an unsupported family
            _check_block(family, module)
            _with_settings(_config_of(family, module), settings)  # every check before a swap
            found.append((name, module))
    if not found:
        raise ValueError(
            f"dtensor_moe.hf.replace_moe_blocks: {type(model).__name__} holds no supported MoE "
            f"block ({', '.join(SUPPORTED_BLOCKS.values())})"
        )
    for name, block in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, moe_from_hf(block, **settings))
    return [name for name, _ in found]


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _hf_entries(prefix: str, source: HFSource, ours: dict) -> list[tuple[str, torch.Tensor]]:
    """The HF keys and tensors of one converted block, popped from its state-dict entries
    ``ours`` (keys relative to the block); anything left in ``ours`` has no HF counterpart."""
    out = [(f"{prefix}gate.weight", ours.pop("router.gate.weight"))]
    if "router.expert_bias" in ours:
        out.append((f"{prefix}gate.e_score_correction_bias", ours.pop("router.expert_bias")))
    w1, w2, w3 = (ours.pop(f"experts.{w}") for w in ("w1", "w2", "w3"))
    out += [
        (f"{prefix}experts.gate_up_proj", torch.cat([w1, w3], dim=1)),
        (f"{prefix}experts.down_proj", w2),
    ]
    if source.shared is not None:
        mlp = f"{prefix}{source.shared}."
        out += [
            (f"{mlp}gate_proj.weight", ours.pop("shared_experts.w1.weight")),
            (f"{mlp}up_proj.weight", ours.pop("shared_experts.w3.weight")),
            (f"{mlp}down_proj.weight", ours.pop("shared_experts.w2.weight")),
        ]
        if source.shared_gate is not None:
            out.append((f"{prefix}{source.shared_gate}.weight",
                        ours.pop("shared_experts.gate.weight")))
    return out


def to_hf_state_dict(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``model``'s state dict with every converted block written back in HF keys and layouts.

    Loadable with ``load_state_dict(..., strict=True)`` into a fresh HF model of the same
    config. DTensor entries (EP, TP, FSDP2) are gathered with ``full_tensor()``, so every rank
    of the model's meshes must call this together; the result holds plain, detached tensors.

    Raises:
        ValueError: ``model`` holds an :class:`MoE` without ``hf_source`` (one not made by
            :func:`moe_from_hf`), whose HF layout is unknown, or a converted block has a state
            entry with no HF counterpart.
    """
    sources = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            source = getattr(module, "hf_source", None)
            if not isinstance(source, HFSource):
                raise ValueError(
                    f"dtensor_moe.hf.to_hf_state_dict: the MoE at {name or '<root>'!r} was not "
                    "made by moe_from_hf/replace_moe_blocks, so its HF layout is unknown"
                )
            sources[f"{name}." if name else ""] = source
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    blocks: dict[str, dict] = {prefix: {} for prefix in sources}
    for key, value in model.state_dict().items():
        value = _full(value).detach()
        prefix = next((p for p in sources if key.startswith(p)), None)
        if prefix is None:
            out[key] = value
        else:
            blocks[prefix][key[len(prefix):]] = value
    for prefix, ours in blocks.items():
        out.update(_hf_entries(prefix, sources[prefix], ours))
        if ours:
            raise ValueError(
                f"dtensor_moe.hf.to_hf_state_dict: {prefix.rstrip('.')} has state entries with "
                f"no {sources[prefix].family} counterpart: {sorted(ours)}"
            )
    return out
