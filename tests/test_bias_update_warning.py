"""A router with ``use_expert_bias=True`` warns once when ``BIAS_UPDATE_WARN_FORWARDS``
training forwards ran without ``update_expert_bias``."""

from __future__ import annotations

import warnings

import pytest
import torch

from dtensor_moe.moe import MoE, MoEConfig, router, update_expert_bias
from dtensor_moe.moe.router import BIAS_UPDATE_WARN_FORWARDS

CONFIG = MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2, use_expert_bias=True)
X = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
SMALL = 6  # the threshold set by the fast tests (the first test runs the real one)


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(router, "BIAS_UPDATE_WARN_FORWARDS", SMALL)


def _warnings_over(moe: MoE, forwards: int, *, no_grad: bool = False) -> list[int]:
    """The forwards (1-based) after which the bias warning came."""
    seen = []
    for i in range(1, forwards + 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(not no_grad):
                moe(X)
        seen += [i for w in caught if "training forwards without update_expert_bias" in str(
            w.message)]
    return seen


def test_the_constant():
    assert BIAS_UPDATE_WARN_FORWARDS == 100  # docs/moe.md states it


def test_warns_once_at_the_nth_training_forward():
    moe = MoE(CONFIG).train()
    assert _warnings_over(moe, BIAS_UPDATE_WARN_FORWARDS + 3) == [BIAS_UPDATE_WARN_FORWARDS]
    # what the warning is about: the counts pile up (3 tokens x top-2 per forward)
    assert int(moe.router.tokens_per_expert.sum()) == (BIAS_UPDATE_WARN_FORWARDS + 3) * 3 * 2


def test_once_per_router(small_threshold):
    moe = MoE(CONFIG).train()
    assert _warnings_over(moe, 3 * SMALL) == [SMALL]


def test_no_warning_when_the_bias_is_updated(small_threshold):
    moe = MoE(CONFIG).train()
    assert _warnings_over(moe, SMALL - 1) == []
    update_expert_bias(moe, 1e-3)
    assert moe.router.forwards_since_bias_update == 0
    assert _warnings_over(moe, SMALL - 1) == []  # the window restarted
    assert _warnings_over(moe, 1) == [1]  # the SMALL-th since the update


def test_eval_forwards_do_not_count_training_no_grad_ones_do(small_threshold):
    """Eval mode counts no tokens and no forwards; a training-mode forward under no_grad
    counts its tokens, so it counts toward the warning too."""
    moe = MoE(CONFIG).eval()
    assert _warnings_over(moe, SMALL + 1) == []
    assert int(moe.router.tokens_per_expert.sum()) == 0
    moe.train()
    assert _warnings_over(moe, SMALL, no_grad=True) == [SMALL]


def test_recompute_and_unbiased_routers_do_not_count(small_threshold):
    moe = MoE(CONFIG).train()
    for _ in range(3):
        torch.utils.checkpoint.checkpoint(moe, X.clone().requires_grad_(), use_reentrant=False).sum()\
            .backward()
    assert moe.router.forwards_since_bias_update == 3  # not 6: the recomputes do not count
    plain = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2)).train()
    assert _warnings_over(plain, SMALL) == []
    assert plain.router.forwards_since_bias_update == 0
