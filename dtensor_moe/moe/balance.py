"""Load balancing: the auxiliary-loss-free expert-bias update and the auxiliary-loss routes.

Shape legend:
    E  routed experts
    N  the routers' counters concatenated (the sum of their E)

Note [Auxiliary loss follows the loss]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The layer returns only ``y``, and keeps no per-forward state on a module, so the auxiliary loss
of one forward must leave the layer some other way. Two routes, one rule: **a collector, when one
is active, takes every auxiliary loss**; ``MoEConfig.aux_loss_mode`` only says what happens
without one.

* **Collect** (exact). Inside ``with collect_aux_losses() as aux:`` each training forward hands
  its loss to ``aux``, and the user adds ``aux.total()`` to the loss. The aux gradient is then
  the gradient of the user's own loss: it follows ``scaler.scale(loss)``, ``loss / n``,
  ``loss * 0`` and any number of backward passes through the output, because it *is* part of
  the loss. The collector is scope state (a module-level stack, like ``torch.no_grad``), not
  module state: each micro-batch opens its own, and two can be in flight. With
  ``aux_loss_mode="collect"`` (the default), a training forward whose loss needs a gradient and
  that finds no collector raises ``ValueError``.
* **Attach** (``aux_loss_mode="attach"``, automatic). ``y`` goes
  through :class:`AuxLossBackward`, an identity whose backward hands the router's
  ``aux_loss_scale`` (1 unless :func:`~dtensor_moe.moe.router.set_router_loss_scale` says
  otherwise) to the loss. Every backward pass through ``y`` adds ``d(aux)/d(router)`` with that
  weight, whatever was done to the loss: it equals adding ``aux`` to the loss for one
  ``(scale * L).backward()``. No automatic rule can do better: ``dL/dy`` is all that reaches
  ``y``, and it does not say by what factor the root of the backward differs from "the loss";
  the scale is configuration (Note [Attached router losses under loss scaling] in
  ``router.py``). This is the route under pipeline schedules, which compute the loss on the
  last stage only (Note [Router losses under pipeline schedules]).

A forward inside a backward pass (an activation-checkpoint recompute) never collects: its value
was collected by the original forward. Under non-reentrant checkpointing the recomputed graph is
discarded, so what it does is moot; under reentrant checkpointing the original forward ran without
grad (nothing to collect) and the recompute's output is what backward flows through, so the loss
is attached there (with the router's ``aux_loss_scale``, as in attach mode). Under
``torch.compile`` the collector stack is read and appended to in the traced graph (a guard on
whether a collector is active, no graph break); the recompute check runs eagerly, so a compiled
region that is recomputed *inside* an open collector (``checkpoint(torch.compile(f))`` with
backward inside the ``with`` block) would collect its loss a second time: run backward after
the block. The value is also kept, detached, in ``router.last_aux_loss`` for logging.

Note [Router losses under pipeline schedules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``torch.distributed.pipelining`` schedule computes the loss with its ``loss_fn`` on the last
stage and runs every backward itself, so no collected loss can be added to it: a collector
open around ``schedule.step()`` would take every stage's router losses and nothing would ever
use them. Both ways of losing them are errors, raised in the stage's first MoE forward (after
the router's own forward collectives, on every rank of the stage alike, before the stage sends
anything): a collect-mode forward without a collector, and a forward inside a stage whose loss
goes to a collector opened outside the stage's forward. A collector opened inside the stage's
forward (by the stage module itself) is the user's to add, and is allowed. The attach route
works under every schedule, with :func:`~dtensor_moe.moe.router.set_router_loss_scale` for a
scaled loss. Whether a stage is running is read from the Python stack
(:func:`dtensor_moe._compat.in_pipeline_stage_forward`); only in eager mode, and only when a
collector takes a loss or none is there to take it.

Note [Counters under pipeline parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A router's ``tokens_per_expert`` counter sums over every training forward since its last reset,
so the micro-batches of one step add up on their own: a schedule that runs ``n`` micro-batches
through a stage leaves the counts of all ``n`` there. Under pipeline parallelism the ranks of
different stages hold different layers, and possibly a different number of MoE layers, so the
counters of a layer may only be summed over the ranks that hold that layer: the ranks of its
stage (``MoEMeshes.stage_group``), where each token of the layer's input is counted on exactly
one rank. A sum over a group reaching into another stage would add another layer's counts, or
wait forever for a rank that has a different number of layers.

``update_expert_bias(stage_module, rate, meshes=meshes)`` sums over ``meshes.stage_group``.
With the meshes, a ``process_group`` is checked before the collective, locally on each rank:
its ranks must lie in the stage (``meshes.stage_ranks``). Without them nothing says where the
stages are: the meshes of the module's DTensor params do not, since a param on a 1-D ``"ep"``
slice lives on a few ranks of the stage while plain replicas of it live on the others (public
``DeviceMesh`` API does not lead from a slice to its root mesh). A stage without a biased router
(dense-only layers) does nothing when the meshes are given: every rank of its stage holds the
same layers, so they all skip the collective alike.
"""

# ruff: noqa: N806

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat
from dtensor_moe.moe.config import AuxLossMode
from dtensor_moe.moe.router import TokenChoiceTopKRouter, bias_dtype

if TYPE_CHECKING:
    from dtensor_moe.parallel.mesh import MoEMeshes

__all__ = [
    "AuxLossBackward",
    "AuxLosses",
    "attach_aux_loss",
    "collect_aux_losses",
    "set_aux_loss_group",
    "update_expert_bias",
]

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


class AuxLosses:
    """The auxiliary losses of the MoE forwards run inside one :func:`collect_aux_losses` block.

    Add :meth:`total` to the loss you call backward on. See Note [Auxiliary loss follows the
    loss].
    """

    __slots__ = ("_in_stage", "_losses")

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        # opened inside a pipeline stage's forward (Note [Router losses under pipeline schedules])
        self._in_stage = False

    def add(self, loss: torch.Tensor) -> None:
        """Take one auxiliary loss (0-dim; what the MoE layers call)."""
        self._losses.append(loss)

    @property
    def losses(self) -> tuple[torch.Tensor, ...]:
        """The collected losses, in forward order: one per MoE forward that computed one."""
        return tuple(self._losses)

    def total(self) -> torch.Tensor:
        """Sum of the collected losses, with their gradient; a float32 zero when there are none."""
        if not self._losses:
            return torch.zeros(())
        return torch.stack(self._losses).sum()

    def __len__(self) -> int:
        return len(self._losses)

    def __repr__(self) -> str:
        return f"AuxLosses(n={len(self._losses)})"


# The open collectors, innermost last: scope state, like a grad-mode stack (never module state).
_COLLECTORS: list[AuxLosses] = []


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[AuxLosses]:
    """Collect the auxiliary losses of the MoE forwards run inside the block.

    Example::

        with collect_aux_losses() as aux:
            logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux.total()
        scaler.scale(loss / grad_accum).backward()   # the aux gradient is scaled with it

    Blocks nest; the innermost takes the losses. Open one per micro-batch. A forward inside a
    backward pass (activation-checkpoint recompute) adds nothing. No collective runs. See
    Note [Auxiliary loss follows the loss].
    """
    collector = AuxLosses()
    if not torch.compiler.is_compiling():
        collector._in_stage = _compat.in_pipeline_stage_forward()
    _COLLECTORS.append(collector)
    try:
        yield collector
    finally:
        _COLLECTORS.remove(collector)


class AuxLossBackward(torch.autograd.Function):
    """``forward(y, aux_loss, scale=1.0) -> y``; backward gives ``y`` its gradient and
    ``aux_loss`` the weight ``scale``.

    The ``"attach"`` route of Note [Auxiliary loss follows the loss]: weight ``scale`` per
    backward pass through ``y``, whatever was done to the loss. ``scale``: a float, or a 0-dim
    tensor whose value is read when the backward runs (Note [Attached router losses under loss
    scaling] in ``router.py``).
    """

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        ctx.scale = scale  # not saved for backward: a tensor's value at backward time counts
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        kwargs = dict(dtype=ctx.aux_dtype, device=ctx.aux_device)  # a copy, never the caller's
        return grad_y, torch.as_tensor(ctx.scale, **kwargs).detach().clone(), None


_NO_COLLECTOR = (
    "an MoE layer with aux_loss_coeff > 0 and aux_loss_mode='collect' ran a training forward "
    "outside collect_aux_losses(), so its auxiliary loss would be lost. Run the forward inside "
    "`with dtensor_moe.collect_aux_losses() as aux:` and add aux.total() to the "
    "loss; or build the layer with MoEConfig(aux_loss_mode='attach') for the automatic route, "
    "and give it the factor of a scaled loss with dtensor_moe.moe.set_router_loss_scale (see "
    "docs/moe.md, 'Auxiliary loss')"
)

_PIPELINE_ADVICE = (
    "A pipeline schedule computes the loss on the last stage and runs backward itself, so no "
    "collected loss can be added to it. Build the MoE layers with "
    "MoEConfig(aux_loss_mode='attach'), and when the schedule's loss is scaled (a GradScaler, "
    "a loss_fn that divides by the number of micro-batches with scale_grads=False) call "
    "dtensor_moe.moe.set_router_loss_scale(stage_module, factor) on every stage (see "
    "docs/pipeline.md)"
)
_STAGE_NO_COLLECTOR = (
    "an MoE layer with aux_loss_mode='collect' and a router loss (aux_loss_coeff > 0 or "
    "z_loss_coeff > 0) ran in a torch.distributed.pipelining stage, where nothing collects its "
    "loss. " + _PIPELINE_ADVICE
)
_STAGE_OUTER_COLLECTOR = (
    "an MoE layer with a router loss (aux_loss_coeff > 0 or z_loss_coeff > 0) ran in a "
    "torch.distributed.pipelining stage inside a collect_aux_losses() block opened outside the "
    "stage (around schedule.step()), so its loss would be collected and never used. "
    + _PIPELINE_ADVICE
)


def _attach_in_recompute(
    y: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """Collect mode without a collector: attach during a recompute, raise otherwise."""
    if not _compat.in_backward_pass():
        in_stage = _compat.in_pipeline_stage_forward()
        raise ValueError(_STAGE_NO_COLLECTOR if in_stage else _NO_COLLECTOR)
    return AuxLossBackward.apply(y, aux_loss, scale)


_attach_in_recompute = torch.compiler.disable(
    _attach_in_recompute,
    reason="whether a forward is an activation-checkpoint recompute is known only at run time",
)


def attach_aux_loss(
    y: torch.Tensor,
    aux_loss: torch.Tensor,
    *,
    mode: AuxLossMode = "attach",
    scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Route ``aux_loss`` (Note [Auxiliary loss follows the loss]); returns ``y``'s value.

    An active :func:`collect_aux_losses` takes the loss (``y`` comes back unchanged). Without
    one, ``mode="attach"`` returns ``y`` through :class:`AuxLossBackward`, whose backward gives
    the loss the weight ``scale`` (the layer passes its router's ``aux_loss_scale``), and
    ``mode="collect"`` raises ``ValueError`` (but attaches inside a backward pass: a checkpoint
    recompute). A loss without grad (a forward under ``torch.no_grad``) goes nowhere. Inside a
    pipeline stage's forward, a collector opened outside the stage raises ``ValueError`` (Note
    [Router losses under pipeline schedules]).
    """
    if mode not in ("collect", "attach"):
        raise ValueError(f"attach_aux_loss: mode={mode!r} is not 'collect' or 'attach'")
    if not aux_loss.requires_grad:
        return y
    if _COLLECTORS and (torch.compiler.is_compiling() or not _compat.in_backward_pass()):
        collector = _COLLECTORS[-1]
        if (
            not torch.compiler.is_compiling()
            and not collector._in_stage
            and _compat.in_pipeline_stage_forward()
        ):
            raise ValueError(_STAGE_OUTER_COLLECTOR)
        collector.add(aux_loss)
        return y
    if mode == "collect":
        return _attach_in_recompute(y, aux_loss, scale)
    return AuxLossBackward.apply(y, aux_loss, scale)


def _biased_routers(module: nn.Module, *, stage_may_lack: bool) -> list[TokenChoiceTopKRouter]:
    routers = [
        m
        for m in module.modules()
        if isinstance(m, TokenChoiceTopKRouter) and m.expert_bias is not None
    ]
    if not routers and not stage_may_lack:
        raise ValueError(
            f"update_expert_bias found no router with an expert bias in {type(module).__name__}; "
            "build the MoE layers with MoEConfig(use_expert_bias=True). For a pipeline stage "
            "that holds no MoE layer, pass meshes=build_moe_meshes(pp=...) (then it does nothing)"
        )
    return routers


def _counter_group(
    process_group: dist.ProcessGroup | None, meshes: object | None
) -> dist.ProcessGroup | None:
    """The group the counters are summed over, checked locally (no collective); Note
    [Counters under pipeline parallelism]."""
    if meshes is not None:
        from dtensor_moe.parallel.mesh import require_meshes  # the parallel package imports moe

        require_meshes(meshes, "update_expert_bias")
    if process_group is None:
        return None if meshes is None else meshes.stage_group
    if meshes is None:  # nothing to check it against: Note [Counters under pipeline parallelism]
        return process_group
    outside = set(dist.get_process_group_ranks(process_group)) - set(meshes.stage_ranks)
    if outside:
        raise ValueError(
            f"update_expert_bias: process_group holds ranks {sorted(outside)} "
            f"outside this pipeline stage (stage {meshes.pp_rank}, ranks "
            f"{list(meshes.stage_ranks)}); the ranks of other stages hold other layers. Pass "
            "meshes=meshes alone (it sums over meshes.stage_group)"
        )
    return process_group


@torch.no_grad()
def update_expert_bias(
    module: nn.Module,
    rate: float,
    *,
    process_group: dist.ProcessGroup | None = None,
    meshes: MoEMeshes | None = None,
) -> None:
    """Auxiliary-loss-free balancing step for every biased router in ``module``.

    For each router: ``bias += rate * centered(sign(mean(c) - c))`` where ``c`` is its
    ``tokens_per_expert`` counter; then the counter is reset to zero. Under-loaded experts gain
    bias and get selected more often; the combine weights never see the bias. A router whose
    counter is all zero keeps its bias. The counters sum over every training forward since the
    last update, so the micro-batches of a step all count. Call it once per optimizer step, for
    example::

        optimizer.register_step_post_hook(lambda *_: update_expert_bias(model, 1e-3))

    Keyword Args:
        process_group: if given, the counters of all routers are summed over this group
            first, in one ``all_reduce`` (the only collective), so that data-parallel ranks
            apply the same update. Without it (and without ``meshes``), a ``module`` with
            DTensor params in a multi-rank run gets a one-time ``UserWarning``: ranks that
            route different tokens would update their biases apart.
        meshes: the :class:`~dtensor_moe.parallel.MoEMeshes` of this rank (of its pipeline
            stage under pipeline parallelism, with ``module`` the stage's module). Without
            ``process_group``, the counters are summed over ``meshes.stage_group``: the ranks
            that hold ``module``'s layers (every rank when ``pp == 1``). A stage without a
            biased router then does nothing (no collective). See Note [Counters under
            pipeline parallelism].

    Raises:
        ValueError: ``rate`` not positive; no biased router in ``module`` (unless ``meshes``
            has ``pp > 1``); ``process_group`` holding a rank outside ``meshes.stage_ranks``
            (a group spanning pipeline stages; checked only when ``meshes`` is given). Each is
            decided locally, before any collective.
    """
    if not rate > 0:
        raise ValueError(f"update_expert_bias needs a positive rate, got {rate}")
    group = _counter_group(process_group, meshes)
    routers = _biased_routers(module, stage_may_lack=meshes is not None and meshes.pp > 1)
    if not routers:
        return  # a pipeline stage of dense layers: its ranks all skip the collective
    if group is None:
        _warn_if_parallel(module)
    # every router's counter in one flat tensor (routers may differ in E): one collective
    counts_N = torch.cat([r.tokens_per_expert.reshape(-1) for r in routers]).to(torch.float64)
    if group is not None:
        dist.all_reduce(counts_N, group=group)
    counts_per_router = counts_N.split([r.tokens_per_expert.numel() for r in routers])
    for router, counts_E in zip(routers, counts_per_router, strict=True):
        delta_E = torch.sign(counts_E.mean() - counts_E)
        active = (counts_E.sum() > 0).to(delta_E.dtype)  # an all-zero counter keeps its bias
        delta_E = (delta_E - delta_E.mean()) * active * rate
        if router.expert_bias.dtype != bias_dtype(router.expert_bias.dtype):  # below float32
            warnings.warn(
                f"update_expert_bias: an expert_bias is {router.expert_bias.dtype}, in which "
                f"steps of rate={rate} near the bias's values may round away and balancing "
                "stall; keep it in float32 (router.expert_bias = router.expert_bias.float(), or "
                "any module cast such as model.float(), which restores it)",
                stacklevel=2,
            )
        router.expert_bias.add_(delta_E.to(router.expert_bias.dtype))
        router.reset_counters()
        router.forwards_since_bias_update = 0  # Note [Expert bias needs its update]


def set_aux_loss_group(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the ``"global_batch"`` balance-loss statistics of every router in ``module`` over
    ``group`` (``None``: back to this rank's batch; Note [Router loss shares] in ``losses.py``).

    ``group`` must hold every rank that routes tokens of the global batch, each token on
    exactly one of them (the dense mesh's dp x tp ranks: ``meshes.stage_group`` for the meshes
    of :func:`~dtensor_moe.parallel.build_moe_meshes`, the default group when ``pp == 1``; under
    pipeline parallelism the statistics are then those of one micro-batch), and every rank of
    it must run each training forward. Each forward then runs one
    ``all_reduce`` of ``2 * E + 2`` floats over ``group`` (in place of the one over tp under
    token parallelism). Configuration, like the parallel styles: call it once, before
    training, on every rank.

    Raises:
        ValueError: when ``module`` holds no router with ``aux_loss_type="global_batch"``.
    """
    routers = [
        m
        for m in module.modules()
        if isinstance(m, TokenChoiceTopKRouter) and m.config.aux_loss_type == "global_batch"
    ]
    if not routers:
        raise ValueError(
            f"set_aux_loss_group found no router with aux_loss_type='global_batch' in "
            f"{type(module).__name__}; build the MoE layers with "
            "MoEConfig(aux_loss_type='global_batch', aux_loss_coeff=...)"
        )
    for router in routers:
        router.aux_loss_group = group
