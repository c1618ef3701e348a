"""The shared experts: an always-on SwiGLU MLP beside the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.moe.config import DeviceLike, factory_kwargs

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """Always-on SwiGLU MLP: ``n`` shared experts of hidden ``h`` fused into one of ``n * h``.

    Fusing is exact: the sum of ``n`` SwiGLU experts equals one SwiGLU whose hidden units are
    their concatenation. With ``gated=True`` (``MoEConfig.shared_expert_gate``) the output is
    scaled per token by ``sigmoid(x @ gate.weight.T)``, ``gate`` an ``nn.Linear(dim, 1)`` without
    bias (Qwen2-MoE). No collective runs here. ``x_TD`` may have any leading shape
    ``(..., dim)``. ``device`` and ``dtype`` are torch's factory arguments for the weights.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        init_std: float = 0.02,
        gated: bool = False,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = factory_kwargs(device, dtype)
        self.init_std = init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, **factory)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.gate = nn.Linear(dim, 1, bias=False, **factory) if gated else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3, self.gate):
            if lin is not None:
                nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``(silu(x @ w1.T) * (x @ w3.T)) @ w2.T``, times ``sigmoid(x @ gate.T)`` when gated,
        through the ``w1``/``w2``/``w3``/``gate`` modules, so that their hooks and adapter swaps
        apply (Note [One forward] in ``tokens.py``)."""
        y_TD = self.w2(F.silu(self.w1(x_TD)) * self.w3(x_TD))
        return y_TD if self.gate is None else torch.sigmoid(self.gate(x_TD)) * y_TD
