"""What ``moe/`` reads of its collaborators: the router protocol, and the meshes of one stage.

Shape legend:
    T  tokens routed by this rank      D  model width
    E  routed experts                  K  experts per token

Note [Router protocol]
~~~~~~~~~~~~~~~~~~~~~~
:class:`~dtensor_moe.moe.MoE` takes any router that is an ``nn.Module`` and has the members of
:class:`Router`; :class:`~dtensor_moe.moe.TokenChoiceTopKRouter` is the one built by default.
Nothing outside ``router.py`` tests for a concrete router class: the layer, the balance and
statistics helpers, the router losses and ``parallelize_moe`` read these members only.

* **The routing output.** ``router(x_TD, tokens=tokens, count=False)`` returns a
  :class:`~dtensor_moe.moe.router.RouterOutput`. ``x_TD`` holds the tokens as the layer
  receives them: a plain ``(T, D)`` tensor in one process, a DTensor of any leading shape under
  tensor or sequence parallelism. ``tokens`` (a :class:`~dtensor_moe.moe.tokens.RoutedTokens`)
  says which tokens this rank routes: run the modules (a gate) on ``x_TD`` and take their
  outputs to this rank's local ``(T, ...)`` tensors with ``tokens.local(t).reshape(T, -1)``;
  ``tokens.owned`` is the part of them this rank counts. ``count=False``: the layer adds
  ``RouterOutput.count_E`` (and ``dropped_E``) to the counters itself, at the end of its
  forward.
* **Counters and bias** (each may be ``None``). ``tokens_per_expert`` and
  ``dropped_per_expert`` are int64 ``(E,)`` counters the layer adds to in training mode
  (not during an activation-checkpoint recompute); ``reset_counters()`` zeroes them.
  ``expert_bias`` (``(E,)``, floating) is what :func:`~dtensor_moe.moe.update_expert_bias`
  moves from ``tokens_per_expert``; a router with a bias therefore keeps the counter too. A
  router without counters is left out by :func:`~dtensor_moe.moe.load_stats` and one without a
  bias by ``update_expert_bias``; each raises ``ValueError`` when no router of the model has
  what it needs.
* **Losses.** ``loss_settings`` (:class:`RouterLossSettings`) says which router losses the
  router computes; a ``"global_batch"`` balance loss gets ``aux_loss_group`` (set by
  :func:`~dtensor_moe.moe.set_aux_loss_group` or ``parallelize_moe``). The loss of a forward
  is ``RouterOutput.aux_loss``; the layer attaches it with the weight ``aux_loss_scale`` (set by
  :func:`~dtensor_moe.moe.set_router_loss_scale`; 1.0 as built).
* **The pipeline stage.** ``stage_ranks`` and ``pp_rank`` start as ``None``;
  ``parallelize_moe`` records the stage there (Note [A router knows its stage] in
  ``balance.py``).
* ``num_experts`` (``E``) must equal the layer's ``MoEConfig.num_experts``;
  ``reset_parameters()`` initialises what the router holds (the layer's ``reset_parameters``
  calls it, Note [Meta-device init] in ``layer.py``).

The package keeps one more attribute on a router with a bias, ``forwards_since_bias_update``
(Note [Expert bias needs its update] in ``router.py``). ``docs/moe.md`` ("Write a router")
walks through a router written as one class; ``tests/test_router_plugin.py`` trains it under
expert, sequence and pipeline parallelism against one process.
"""

# ruff: noqa: N803

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from dtensor_moe.moe.config import AuxLossType

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from dtensor_moe.moe.router import RouterOutput
    from dtensor_moe.moe.tokens import RoutedTokens

__all__ = [
    "Router",
    "RouterLossSettings",
    "StageMeshes",
    "check_router",
    "is_router",
    "require_stage_meshes",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterLossSettings:
    """The router losses a router computes (Note [Router loss shares] in ``losses.py``).

    Attributes:
        aux_loss_coeff: coefficient of the balance loss; ``0``: none.
        aux_loss_type: ``"sequence"`` or ``"global_batch"`` (whose statistics are summed over
            the router's ``aux_loss_group``).
        z_loss_coeff: coefficient of the z-loss; ``0``: none.
    """

    aux_loss_coeff: float = 0.0
    aux_loss_type: AuxLossType = "sequence"
    z_loss_coeff: float = 0.0


@runtime_checkable
class Router(Protocol):
    """What an MoE router has: Note [Router protocol]. A router is also an ``nn.Module``."""

    num_experts: int
    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor | None
    dropped_per_expert: torch.Tensor | None
    loss_settings: RouterLossSettings
    aux_loss_group: object | None
    aux_loss_scale: float | torch.Tensor
    stage_ranks: tuple[int, ...] | None
    pp_rank: int | None

    def forward(
        self, x_TD: torch.Tensor, *, tokens: RoutedTokens | None = None, count: bool = True
    ) -> RouterOutput: ...

    def reset_parameters(self) -> None: ...

    def reset_counters(self) -> None: ...


_METHODS = ("forward", "reset_parameters", "reset_counters")
ROUTER_MEMBERS = (*Router.__annotations__, *_METHODS)


def is_router(module: object) -> bool:
    """Whether ``module`` is an ``nn.Module`` with every member of :class:`Router`."""
    return isinstance(module, nn.Module) and isinstance(module, Router)


def check_router(router: object, *, num_experts: int, caller: str = "MoE") -> Router:
    """``router`` if it plugs into a layer of ``num_experts`` experts (Note [Router
    protocol]); ``TypeError`` or ``ValueError`` naming the router and what it lacks otherwise.
    Local: no collective."""
    name = type(router).__name__
    if not isinstance(router, nn.Module):
        raise TypeError(
            f"{caller}: the router must be an nn.Module (its parameters train and are "
            f"parallelized with the layer's), got {name}"
        )
    missing = [m for m in ROUTER_MEMBERS if not hasattr(router, m)]
    missing += [m for m in _METHODS if m not in missing and not callable(getattr(router, m))]
    if missing:
        raise TypeError(
            f"{caller}: router {name} lacks {', '.join(missing)} of the router protocol "
            "(dtensor_moe.moe.Router); set the attributes it does not use to None (the counters "
            "and bias), RouterLossSettings() (the losses), 1.0 (aux_loss_scale); see "
            "docs/moe.md, 'Write a router'"
        )
    if router.num_experts != num_experts:
        raise ValueError(
            f"{caller}: router {name} routes to num_experts={router.num_experts} experts but the "
            f"layer has {num_experts} (MoEConfig.num_experts); build both with the same count"
        )
    if not isinstance(router.loss_settings, RouterLossSettings):
        raise TypeError(
            f"{caller}: router {name}.loss_settings must be a RouterLossSettings, got "
            f"{type(router.loss_settings).__name__}"
        )
    if router.expert_bias is not None and router.tokens_per_expert is None:
        raise ValueError(
            f"{caller}: router {name} holds an expert_bias but no tokens_per_expert counter; "
            "update_expert_bias moves the bias from that counter: register both, or neither"
        )
    return router


@runtime_checkable
class StageMeshes(Protocol):
    """What ``moe/`` reads of the meshes of one rank's pipeline stage (the
    :class:`~dtensor_moe.MoEMeshes` of :func:`~dtensor_moe.build_moe_meshes`)."""

    pp: int
    pp_rank: int
    pp_mesh: DeviceMesh | None
    stage_ranks: tuple[int, ...]
    stage_group: dist.ProcessGroup | None


def require_stage_meshes(meshes: object, caller: str) -> StageMeshes:
    """``meshes`` if it has the members of :class:`StageMeshes`, else ``TypeError`` naming
    ``caller``. Local: no collective."""
    if not isinstance(meshes, StageMeshes):
        raise TypeError(
            f"{caller}: meshes must be the MoEMeshes of build_moe_meshes, got "
            f"{type(meshes).__name__}"
        )
    return meshes
