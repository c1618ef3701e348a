"""Muon in one process: against ``torch.optim.Muon``, the param split, the errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dtensor_moe.demo.model import ModelConfig, MoETransformer
from dtensor_moe.moe import MoEConfig
from dtensor_moe.optim import Muon, muon_param_groups
from dtensor_moe.optim.muon import _deal_owners, newton_schulz
from tests._moe_model import make_model

SHAPES = [(8, 6), (6, 8), (4, 10, 6), (3, 5, 12)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"lr": 0.02, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
        {"lr": torch.tensor(0.01), "weight_decay": 0.0, "adjust_lr_fn": "original",
         "momentum": 0.9, "ns_steps": 3},
    ],
    ids=["defaults", "no_nesterov_match_rms", "tensor_lr_original"],
)
def test_matches_torch_muon_bit_for_bit(kwargs):
    # plain 2-D params and 3-D expert weights, 3 steps; torch steps each expert as its own
    # 2-D param (its shape decides the adjusted lr), our batched Newton-Schulz gives the same bits
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [[p.clone().requires_grad_()] if p.ndim == 2 else
           [e.clone().requires_grad_() for e in p.unbind(0)] for p in init]
    opt = Muon(ours, **kwargs)
    opt_ref = torch.optim.Muon([x for xs in ref for x in xs], **kwargs)
    for step in range(3):
        for p, xs, g in zip(ours, ref, _grads(step), strict=True):
            p.grad = g.clone()
            for x, gx in zip(xs, [g] if g.ndim == 2 else g.unbind(0), strict=True):
                x.grad = gx.clone()
        opt.step()
        opt_ref.step()
    for p, xs in zip(ours, ref, strict=True):
        want = xs[0] if p.ndim == 2 else torch.stack(xs)
        assert torch.equal(p, want)
    assert set(opt.state[ours[2]]) == {"momentum_buffer"}


def test_newton_schulz_batched_equals_per_matrix():
    x = torch.randn(5, 24, 16)
    batched = newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    single = torch.stack([newton_schulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in x])
    assert batched.dtype == torch.bfloat16 and torch.equal(batched, single)
    assert torch.equal(x, x.clone())  # the input is left alone
    bf = x[0].bfloat16()
    before = bf.clone()
    newton_schulz(bf, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(bf, before)


def test_float32_newton_schulz_and_torch_state_dicts():
    # ns_dtype=float32 runs the same iteration in float32; a state_dict of torch.optim.Muon
    # (no ns_dtype in its groups) loads and steps with torch's bfloat16
    x = torch.randn(6, 10)
    ortho = newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    assert ortho.dtype == torch.float32
    assert (ortho.bfloat16().float() - newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
            .float()).abs().max() < 0.05
    p = torch.ones(3, 4, requires_grad=True)
    q = torch.ones(3, 4, requires_grad=True)
    p.grad, q.grad = torch.randn(3, 4), torch.randn(3, 4)
    ref = torch.optim.Muon([p])
    ref.step()
    ours = Muon([q], ns_dtype=torch.float32)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch would share the buffer
    assert ours.param_groups[0]["ns_dtype"] == torch.bfloat16
    q.data.copy_(p.detach())
    q.grad = p.grad.clone()
    ref.step()
    ours.step()
    assert torch.equal(p, q)


def test_owners_spread_by_cost():
    # 1 large and 6 small matrices over 4 coordinates: the large one alone, the small ones
    # spread over the other three; ties rotate with the offset
    owners = _deal_owners([1000] + [10] * 6, (4,), offset=0)
    assert owners[0] == (0,) and sorted(o[0] for o in owners[1:]) == [1, 1, 2, 2, 3, 3]
    assert _deal_owners([5], (4,), offset=2) == [(2,)]
    assert _deal_owners([5, 5, 5, 5], (2, 2), offset=0) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_param_groups_of_the_tiny_lm_and_the_demo_model():
    groups = muon_param_groups(make_model())
    assert groups.adamw_names == (
        "embed.weight", "layers.0.norm1.weight", "layers.0.norm2.weight",
        "layers.0.moe.router.gate.weight", "layers.1.norm1.weight", "layers.1.norm2.weight",
        "layers.1.moe.router.gate.weight", "norm.weight", "head.weight",
    )
    assert "layers.0.moe.experts.w1" in groups.muon_names
    assert "layers.0.moe.shared_experts.w2.weight" in groups.muon_names
    assert all(p.ndim in (2, 3) for p in groups.muon)
    demo = MoETransformer(ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2,
                                      moe=MoEConfig(dim=16, hidden_dim=32, num_experts=4,
                                                    top_k=2)))
    demo_groups = muon_param_groups(demo)
    assert "output.weight" in demo_groups.adamw_names
    assert "tok_embeddings.weight" in demo_groups.adamw_names
    assert "layers.0.attention.wq.weight" in demo_groups.muon_names
    total = len(demo_groups.muon) + len(demo_groups.adamw)
    assert total == len(list(demo.parameters()))
    over = muon_param_groups(make_model(), adamw=["layers.*.up.weight"], muon=["head.weight"])
    assert "layers.0.up.weight" in over.adamw_names and "head.weight" in over.muon_names
    with pytest.raises(ValueError, match=r"norm.weight \(shape \(16,\)\) matches a muon pattern"):
        muon_param_groups(make_model(), muon=["norm.weight"])


@pytest.mark.parametrize(
    "make, kwargs, message",
    [
        (lambda: [torch.ones(4)], {}, r"shape \(4,\): Muon steps 2-D matrices .* and 3-D"),
        (lambda: [torch.ones(2, 2, 2, 2)], {}, r"shape \(2, 2, 2, 2\): Muon steps 2-D"),
        (lambda: [torch.ones(2, 2)], {"lr": math.nan}, "lr must be a finite number >= 0, got nan"),
        (lambda: [torch.ones(2, 2)], {"lr": math.inf}, "lr must be a finite number"),
        (lambda: [torch.ones(2, 2)], {"lr": -1.0}, "lr must be a finite number >= 0, got -1.0"),
        (lambda: [torch.ones(2, 2)], {"momentum": -0.5}, "momentum must be a finite number"),
        (lambda: [torch.ones(2, 2)], {"weight_decay": math.nan}, "weight_decay must be a finite"),
        (lambda: [torch.ones(2, 2)], {"adjust_lr_fn": "rms"}, "adjust_lr_fn 'rms' is not supp"),
        (lambda: [torch.ones(2, 2)], {"ns_steps": 100}, r"ns_steps must be an int in \[0, 100\)"),
        (lambda: [torch.ones(2, 2)], {"ns_coefficients": (1.0, 2.0)}, "three numbers"),
        (lambda: [torch.ones(2, 2)], {"ns_dtype": torch.int32}, "ns_dtype must be a floating"),
        (lambda: [torch.ones(2, 2)], {"lr": torch.ones(2)}, "a tensor lr must have one element"),
        (lambda: [torch.ones(2, 2, dtype=torch.complex64)], {}, "Muon supports real params only"),
    ],
)
def test_bad_input_is_rejected_at_construction(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon(make(), **kwargs)


def test_bad_input_at_step_leaves_params_alone():
    p = torch.ones(3, 4, requires_grad=True)
    opt = Muon([p])
    p.grad = torch.ones(3, 4).to_sparse()
    with pytest.raises(ValueError, match="param 0: Muon does not support sparse gradients"):
        opt.step()
    p.grad = torch.ones(3, 4)
    opt.param_groups[0]["lr"] = math.nan  # e.g. from a scheduler
    with pytest.raises(ValueError, match="Muon param group 0: lr must be a finite number"):
        opt.step()
    assert torch.equal(p, torch.ones(3, 4)) and not opt.state
    with pytest.raises(ValueError, match=r"param group 1, param 0 has shape \(5,\)"):
        opt.add_param_group({"params": [torch.ones(5)]})
