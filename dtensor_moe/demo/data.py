"""Synthetic, learnable language data: sequences drawn from a fixed random Markov chain.

Shape legend:
    V  vocabulary size (states of the chain)
    B  sequences in the global batch, L  tokens per sequence

Each token depends only on the one before it, through a transition matrix ``P_VV`` that is fixed
by the seed. A model that predicts the next token can therefore do no better than the chain's
*entropy rate* ``H = -sum_i pi_i sum_j P_ij log P_ij`` (in nats, ``pi`` the stationary
distribution), and a good one gets close to it. Sequences start from ``pi``, so every position
has the same optimum ``H``.

The global batch of step ``s`` is a pure function of ``(seed, s)``: every rank draws the whole
batch and keeps its data-parallel slice, and a single-process run sees exactly the same tokens.
"""

# ruff: noqa: N803, N806, N815

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MarkovChain"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkovChain:
    """A random first-order Markov chain over ``V`` tokens.

    Each token has ``branching`` likely successors (most of the probability mass), which makes
    the data learnable in a few hundred steps while keeping the entropy rate well above zero.
    """

    transitions_VV: torch.Tensor
    stationary_V: torch.Tensor
    seed: int

    @classmethod
    def random(cls, vocab_size: int, *, seed: int, branching: int = 4) -> MarkovChain:
        gen = torch.Generator().manual_seed(seed)
        V = vocab_size
        logits_VV = torch.randn(V, V, generator=gen, dtype=torch.float64)
        likely_VK = torch.rand(V, V, generator=gen).argsort(dim=-1)[:, :branching]
        logits_VV.scatter_add_(1, likely_VK, torch.full((V, branching), 6.0, dtype=torch.float64))
        transitions_VV = torch.softmax(logits_VV, dim=-1)
        return cls(
            transitions_VV=transitions_VV, stationary_V=_stationary(transitions_VV), seed=seed
        )

    @property
    def vocab_size(self) -> int:
        return self.transitions_VV.shape[0]

    def entropy_rate(self) -> float:
        """``-sum_i pi_i sum_j P_ij log P_ij`` in nats: the best achievable next-token loss."""
        P = self.transitions_VV
        row_entropy_V = -(P * P.clamp_min(1e-300).log()).sum(dim=-1)
        return float((self.stationary_V * row_entropy_V).sum())

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs_BL, targets_BL)`` of step ``step``: ``targets[:, t] = inputs[:, t + 1]``.

        Draws ``seq_len + 1`` tokens per sequence; the same ``(step, batch_size, seq_len)`` gives
        the same tokens in every process.
        """
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        cdf_VV = self.transitions_VV.cumsum(dim=-1)
        cdf_VV[:, -1] = 1.0
        uniform_BL = torch.rand(batch_size, seq_len + 1, generator=gen, dtype=torch.float64)
        tokens_BL = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        start_cdf = self.stationary_V.cumsum(dim=0)
        start_cdf[-1] = 1.0
        tokens_BL[:, 0] = torch.searchsorted(start_cdf, uniform_BL[:, 0].contiguous())
        for t in range(1, seq_len + 1):
            rows_BV = cdf_VV[tokens_BL[:, t - 1]]
            tokens_BL[:, t] = torch.searchsorted(
                rows_BV, uniform_BL[:, t : t + 1].contiguous()
            ).squeeze(-1)
        return tokens_BL[:, :-1], tokens_BL[:, 1:]


def _stationary(transitions_VV: torch.Tensor) -> torch.Tensor:
    """The stationary distribution ``pi = pi P`` by power iteration (the chain is irreducible)."""
    pi_V = torch.full(
        (transitions_VV.shape[0],), 1.0 / transitions_VV.shape[0], dtype=torch.float64
    )
    for _ in range(1000):
        pi_V = pi_V @ transitions_VV
    return pi_V / pi_V.sum()
