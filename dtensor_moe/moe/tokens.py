"""Which tokens one MoE forward routes on this rank, and how its output goes back.

Note [One forward]
~~~~~~~~~~~~~~~~~~
:class:`~dtensor_moe.moe.MoE` has one forward under every layout. It calls its children as
modules, ``router`` (which calls ``router.gate``), ``experts`` and ``shared_experts``, so that
their hooks, ``fully_shard`` units, activation-checkpoint wrappers and adapter swaps work the
same with or without parallelism. What differs between layouts is described by a
:class:`RoutedTokens` that the forward receives:

* one process, or data/expert parallelism with plain-tensor inputs: the default, built by the
  forward itself: every token of the batch, plain tensors, ``local`` is the identity;
* tensor or sequence parallelism: :class:`~dtensor_moe.parallel.PrepareMoEInput` registers a
  forward pre-hook (its input function) that turns the input into the DTensor of the tokens this
  rank routes and passes a :class:`~dtensor_moe.parallel.token_parallel.TokenSplit` as the
  ``tokens`` keyword, and a forward hook (its output function) that brings the output back to
  the input's layout, as torch's own ``PrepareModuleInput``/``PrepareModuleOutput`` do.

The gate and the shared experts then run on the token DTensor with DTensor weights (DTensor
derives their gradients); :meth:`RoutedTokens.local` hands the router's logits, the shared
output and the tokens to the routed region (top-k, dispatch, experts, combine) as local tensors
with the gradient placements the region's output implies. A ``RoutedTokens`` is built per
forward and held by nobody after it: no module keeps per-forward state.
"""

# ruff: noqa: N806

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor_moe.moe.losses import LossTokens

__all__ = ["RoutedTokens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutedTokens:
    """The tokens one forward routes on this rank: all of a batch, in one process.

    Attributes:
        num_sequences: ``B``, sequences of the batch (the data shard).
        seq_len: ``L``, tokens per sequence (the global length under sequence parallelism).
        local_shape: shape of this rank's block of the routed tokens (the layer's input shape
            in one process).
        owned: the routed tokens this rank counts in ``tokens_per_expert`` and whose share of
            the router losses it carries; ``None``: all of them.
    """

    num_sequences: int
    seq_len: int
    local_shape: tuple[int, ...]
    owned: slice | None = None

    @classmethod
    def whole_batch(cls, shape: tuple[int, int, int]) -> RoutedTokens:
        """Every token of a ``(B, L, D)`` batch."""
        B, L, _ = shape
        return cls(num_sequences=max(B, 1), seq_len=L, local_shape=tuple(shape))

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the gate logits, the shared output, the tokens) as the routed region's local
        tensor; the identity for plain tensors."""
        return t

    def loss_tokens(self, num_tokens: int, device: torch.device) -> LossTokens:
        """The routed tokens for the router losses (Note [Router loss shares])."""
        return LossTokens.whole(num_tokens, self.num_sequences, device)

    def batch_table(
        self, ids_TK: torch.Tensor, scores_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The routing table of the whole batch, in global token order, and the rows of it that
        are this rank's tokens (``None``: all of them, in order). Here the rank routes the
        whole batch: no collective. See Note [Expert capacity] in ``capacity.py``."""
        return ids_TK, scores_TK, None

    def output(self, y_TD: torch.Tensor) -> torch.Tensor:
        """The routed region's ``(T, D)`` output in the layer's output layout."""
        return y_TD.view(self.local_shape)
