"""Load balancing: the auxiliary-loss-free expert-bias update and the auxiliary-loss hook.

Shape legend:
    E  routed experts
    M  MoE routers with an expert bias in the module tree being updated

Note [Auxiliary loss through autograd]: the layer returns only ``y``. To keep no per-forward
state on a module, the sequence-level auxiliary loss travels with the output: ``y`` is passed
through :class:`AuxLossBackward`, an identity whose backward also returns ``1`` as the gradient
of the loss. Any backward pass through ``y`` therefore adds ``d(aux_loss)/d(router weights)``,
exactly as if ``aux_loss`` had been added to the training loss with weight 1. This survives
activation-checkpoint recompute and several micro-batches in flight, because each output
carries its own loss. The value is kept, detached, in ``router.last_aux_loss`` for logging.
"""

# ruff: noqa: N806

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.moe.router import TokenChoiceTopKRouter

__all__ = ["AuxLossBackward", "attach_aux_loss", "update_expert_bias"]

# Set on a module once _warn_if_parallel has checked it: the state lives on the module itself.
_CHECKED_ATTR = "_dtensor_moe_bias_update_checked"


def _warn_if_parallel(module: nn.Module) -> None:
    """Warn once per module when a parallelized model updates its bias from local counters."""
    if getattr(module, _CHECKED_ATTR, False):
        return
    object.__setattr__(module, _CHECKED_ATTR, True)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        warnings.warn(
            f"update_expert_bias({type(module).__name__}, ...) without process_group in a "
            f"{dist.get_world_size()}-rank run: {type(module).__name__} has DTensor params, so "
            "its ranks likely route different tokens, and each would update its expert bias "
            "from its own counters; the biases then drift apart across ranks. Pass "
            "process_group=dist.group.WORLD (or a group covering every rank that routes "
            "tokens).",
            UserWarning,
            stacklevel=3,
        )


class AuxLossBackward(torch.autograd.Function):
    """``forward(y, aux_loss) -> y``; backward gives ``y`` its gradient and ``aux_loss`` 1.

    See Note [Auxiliary loss through autograd].
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_y, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


def attach_aux_loss(y: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """Return ``y`` unchanged in value; backward through it also backpropagates ``aux_loss``."""
    if not aux_loss.requires_grad:
        return y
    return AuxLossBackward.apply(y, aux_loss)


def _biased_routers(module: nn.Module) -> list[TokenChoiceTopKRouter]:
    routers = [
        m
        for m in module.modules()
        if isinstance(m, TokenChoiceTopKRouter) and m.expert_bias is not None
    ]
    if not routers:
        raise ValueError(
            f"update_expert_bias found no router with an expert bias in {type(module).__name__}; "
            "build the MoE layers with MoEConfig(use_expert_bias=True)"
        )
    return routers


@torch.no_grad()
def update_expert_bias(
    module: nn.Module, rate: float, *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Auxiliary-loss-free balancing step for every biased router in ``module``.

    For each router: ``bias += rate * centered(sign(mean(c) - c))`` where ``c`` is its
    ``tokens_per_expert`` counter; then the counter is reset to zero. Under-loaded experts gain
    bias and get selected more often; the combine weights never see the bias. A router whose
    counter is all zero keeps its bias. Call it once per optimizer step, for example::

        optimizer.register_step_post_hook(lambda *_: update_expert_bias(model, 1e-3))

    Keyword Args:
        process_group: if given, the counters of all routers are summed over this group
            first, in one ``all_reduce`` (the only collective), so that data-parallel ranks
            apply the same update. Without it, a ``module`` with DTensor params in a
            multi-rank run gets a one-time ``UserWarning``: ranks that route different tokens
            would update their biases apart.
    """
    if not rate > 0:
        raise ValueError(f"update_expert_bias needs a positive rate, got {rate}")
    routers = _biased_routers(module)
    if process_group is None:
        _warn_if_parallel(module)
    counts_ME = torch.stack([r.tokens_per_expert for r in routers]).to(torch.float64)
    if process_group is not None:
        dist.all_reduce(counts_ME, group=process_group)
    delta_ME = torch.sign(counts_ME.mean(dim=-1, keepdim=True) - counts_ME)
    delta_ME = delta_ME - delta_ME.mean(dim=-1, keepdim=True)
    active_M1 = (counts_ME.sum(dim=-1, keepdim=True) > 0).to(delta_ME.dtype)
    delta_ME = delta_ME * active_M1 * rate
    for router, delta_E in zip(routers, delta_ME):
        router.expert_bias.add_(delta_E.to(router.expert_bias.dtype))
        router.tokens_per_expert.zero_()
