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
(:func:`dtensor_moe._compat.in_pipeline_stage_forward`, and
:func:`~dtensor_moe._compat.in_pipeline_metadata_inference` for the forward that torch runs
before the first step of a stage built without static metadata); only in eager mode, and only
when a collector takes a loss or none is there to take it.

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
A ``process_group`` is checked before the collective, locally on each rank: its ranks must lie
in the stage, ``meshes.stage_ranks`` with the meshes, and the stage recorded on the routers
without them (Note [A router knows its stage]). A stage without a biased router (dense-only
layers) skips the counters' collective when the meshes are given: every rank of its stage holds
the same layers, so they all skip it alike. Whether *any* stage holds one is agreed once (Note
[A model without a biased router]).

Note [A router knows its stage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The meshes of a module's DTensor params do not say where the pipeline stages are: a param on a
1-D ``"ep"`` slice lives on a few ranks of the stage while plain replicas of it live on the
others, and public ``DeviceMesh`` API does not lead from a slice to its root mesh. So
:func:`parallelize_moe`, which has the stage's meshes, records them on
every router of the model it parallelizes (at any ``pp``): ``router.stage_ranks`` (the stage's
global ranks, every rank when ``pp == 1``) and ``router.pp_rank``. The helpers that take a
process group, :func:`update_expert_bias`, :func:`~dtensor_moe.moe.load_stats` (its default
``"world"`` included) and :func:`set_aux_loss_group` (and ``parallelize_moe`` itself, for a
group set before it), refuse a group that holds a rank outside the stage of one of the
module's routers, with or without ``meshes=``, locally and before any collective. Under
pipeline parallelism every stage's ranks then raise alike: a group such as the world holds
ranks outside every stage, and a stage without routers finds no router to work on, which each
of these helpers refuses without ``meshes=``. A router parallelized without ``parallelize_moe``
(the styles applied by hand) has no record; only ``meshes=`` checks its group.

Note [A model without a biased router]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``meshes.pp > 1`` a stage without a biased router is fine, but the whole model without
one means ``use_expert_bias`` was forgotten, which at ``pp == 1`` raises. No stage can tell on
its own, so the first call of :func:`update_expert_bias` with such meshes on a module runs one
``all_reduce`` (sum) of the number of biased routers in the module over ``meshes.pp_mesh``: one
rank of every stage, so every rank gets the count of the whole model. Zero raises
``ValueError`` on every rank alike; otherwise the answer is kept on the module (an attribute,
like the warning flag of ``_warn_if_parallel``) and later calls skip the collective. Under an
interleaved or V-shaped schedule a rank passes all its stage modules in one call (an
``nn.ModuleList`` of them): one module per call would sum a part of the model only.
"""

# ruff: noqa: N806

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe import _compat
from dtensor_moe.moe.config import AuxLossMode
from dtensor_moe.moe.protocol import Router, StageMeshes, is_router, require_stage_meshes
from dtensor_moe.moe.router import bias_dtype

__all__ = [
    "AuxLossBackward",
    "AuxLosses",
    "attach_aux_loss",
    "check_group_in_stage",
    "collect_aux_losses",
    "set_aux_loss_group",
    "update_expert_bias",
]

# Set on a module once _warn_if_parallel has checked it: the state lives on the module itself.
_CHECKED_ATTR = "_dtensor_moe_bias_update_checked"
# Set on a module once the stages have agreed that the model holds a biased router (Note [A
# model without a biased router]).
_MODEL_BIASED_ATTR = "_dtensor_moe_model_has_expert_bias"


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
        collector._in_stage = _in_stage()
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
    tensor whose value is read when the backward runs in eager mode and at the forward under
    ``torch.compile`` (Note [Attached router losses under loss scaling] in ``router.py``).
    """

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        ctx.scale = scale  # not saved for backward: eagerly, a tensor's value at backward counts
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


def _in_stage() -> bool:
    """A stage's forward: a schedule's, or the one of torch's metadata inference that runs
    before a stage's first step (Note [Counting under pipeline metadata inference] in
    ``router.py``)."""
    return _compat.in_pipeline_stage_forward() or _compat.in_pipeline_metadata_inference()


def _attach_in_recompute(
    y: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """Collect mode without a collector: attach during a recompute, raise otherwise."""
    if not _compat.in_backward_pass():
        raise ValueError(_STAGE_NO_COLLECTOR if _in_stage() else _NO_COLLECTOR)
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
            and _in_stage()
        ):
            raise ValueError(_STAGE_OUTER_COLLECTOR)
        collector.add(aux_loss)
        return y
    if mode == "collect":
        return _attach_in_recompute(y, aux_loss, scale)
    return AuxLossBackward.apply(y, aux_loss, scale)


def check_group_in_stage(
    routers: list[Router], group: dist.ProcessGroup | None, caller: str, fix: str
) -> None:
    """Raise ``ValueError`` when ``group`` holds a rank outside the pipeline stage recorded on
    one of ``routers`` (Note [A router knows its stage]). Local: no collective."""
    stages = {(r.pp_rank, r.stage_ranks) for r in routers if r.stage_ranks is not None}
    if group is None or not stages:
        return
    ranks = set(dist.get_process_group_ranks(group))
    for pp_rank, stage_ranks in sorted(stages):
        outside = sorted(ranks - set(stage_ranks))
        if outside:
            raise ValueError(
                f"{caller}: the process group holds ranks {outside} outside the pipeline stage "
                f"of the module's routers (stage {pp_rank}, ranks {list(stage_ranks)}, as "
                "parallelize_moe recorded); the ranks of other stages hold other layers, so a "
                f"sum over them would mix layers or wait forever. {fix}"
            )


def _biased_routers(module: nn.Module, *, stage_may_lack: bool) -> list[Router]:
    """The routers of ``module`` that hold an expert bias (Note [Router protocol] in
    ``protocol.py``: routers without one are left out)."""
    all_routers = [m for m in module.modules() if is_router(m)]
    routers = [r for r in all_routers if r.expert_bias is not None]
    if not routers and not stage_may_lack:
        unbiased = sorted({type(r).__name__ for r in all_routers})
        held = f". Its routers ({', '.join(unbiased)}) hold none" if unbiased else ""
        raise ValueError(
            f"update_expert_bias found no router with an expert bias in {type(module).__name__}; "
            "build the MoE layers with MoEConfig(use_expert_bias=True). For a pipeline stage "
            f"that holds no MoE layer, pass meshes=build_moe_meshes(pp=...) (then it does "
            f"nothing){held}"
        )
    return routers


def _check_rate(rate: float) -> None:
    """``rate`` is a positive finite number. Local: no collective."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"update_expert_bias: rate must be a real number, got {rate!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(
            f"update_expert_bias needs a positive rate, got {rate!r}; pass a finite number "
            "such as 1e-3 (DeepSeek-V3's)"
        )


def _check_step(module: nn.Module, rate: float, routers: list[Router]) -> None:
    """No bias can leave its dtype's finite range in one step (a step moves an entry by at
    most ``2 * rate``). Local: no collective."""
    names = {id(m): name for name, m in module.named_modules()}
    for router in routers:
        bias = router.expert_bias
        reach = bias.detach().abs().max().double() + 2 * float(rate)
        if not bool(torch.isfinite(reach.to(bias.dtype))):
            raise ValueError(
                f"update_expert_bias: rate={rate!r} could make the expert bias of "
                f"{names.get(id(router), 'a router')!r} non-finite (a step moves an entry by up "
                f"to 2 * rate; {bias.dtype} holds values up to "
                f"{torch.finfo(bias.dtype).max:g}), and an infinite bias disables experts for "
                "good; use a small rate such as 1e-3"
            )


def _counter_group(
    process_group: dist.ProcessGroup | None, meshes: object | None
) -> dist.ProcessGroup | None:
    """The group the counters are summed over, checked locally (no collective); Note
    [Counters under pipeline parallelism]."""
    if meshes is not None:
        require_stage_meshes(meshes, "update_expert_bias")
    if process_group is None:
        return None if meshes is None else meshes.stage_group
    if meshes is None:  # checked against the routers' record: Note [A router knows its stage]
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


def _agree_model_has_bias(module: nn.Module, routers: list[Router], meshes: StageMeshes) -> None:
    """Note [A model without a biased router]: one ``all_reduce`` over ``meshes.pp_mesh`` on the
    first call for ``module``, none afterwards; ``ValueError`` on every rank when no stage
    holds a biased router."""
    if getattr(module, _MODEL_BIASED_ATTR, False):
        return
    count = torch.tensor([len(routers)], dtype=torch.int64)
    dist.all_reduce(count, group=meshes.pp_mesh.get_group())
    if count.item() == 0:
        raise ValueError(
            f"update_expert_bias found no router with an expert bias in any of the "
            f"{meshes.pp} pipeline stages (this rank's module: {type(module).__name__}); build "
            "the MoE layers with MoEConfig(use_expert_bias=True). A rank that runs several "
            "stages passes them in one call, as an nn.ModuleList"
        )
    object.__setattr__(module, _MODEL_BIASED_ATTR, True)


@torch.no_grad()
def update_expert_bias(
    module: nn.Module,
    rate: float,
    *,
    process_group: dist.ProcessGroup | None = None,
    meshes: StageMeshes | None = None,
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
            first, in one ``all_reduce``, so that data-parallel ranks apply the same update.
            It must lie inside the pipeline stage of the module's routers (Note [A router
            knows its stage]). Without it (and without ``meshes``), a ``module`` with DTensor
            params in a multi-rank run gets a one-time ``UserWarning``: ranks that route
            different tokens would update their biases apart.
        meshes: the :class:`~dtensor_moe.MoEMeshes` of this rank (of its pipeline
            stage under pipeline parallelism, with ``module`` the stage's module, or an
            ``nn.ModuleList`` of a rank's stage modules). Without ``process_group``, the
            counters are summed over ``meshes.stage_group``: the ranks that hold ``module``'s
            layers (every rank when ``pp == 1``). A stage without a biased router then runs no
            counter collective. See Note [Counters under pipeline parallelism].

    Collectives: one ``all_reduce`` of the counters over the group (none on a pipeline stage
    without a biased router); with ``meshes.pp > 1``, the first call for ``module`` also runs
    one ``all_reduce`` of one int over ``meshes.pp_mesh`` (Note [A model without a biased
    router]).

    Raises:
        TypeError: ``rate`` is not a real number.
        ValueError: ``rate`` not positive and finite, or so large that a bias could become
            non-finite; ``process_group`` holding a rank outside the stage (of
            ``meshes.stage_ranks``, or recorded on the routers by ``parallelize_moe``); no
            biased router in ``module`` (without ``meshes``, or with ``pp == 1``) or in any
            stage (with ``meshes.pp > 1``, after the agreement, on every rank alike). The
            others are decided locally, before any collective.
    """
    _check_rate(rate)
    group = _counter_group(process_group, meshes)
    pipelined = meshes is not None and meshes.pp > 1
    routers = _biased_routers(module, stage_may_lack=pipelined)
    _check_step(module, rate, routers)
    all_routers = [m for m in module.modules() if is_router(m)]
    fix = "Pass meshes=meshes (it sums over meshes.stage_group) instead of process_group"
    check_group_in_stage(all_routers, group, "update_expert_bias", fix)
    if pipelined:
        _agree_model_has_bias(module, routers, meshes)
    if not routers:
        return  # a pipeline stage of dense layers: its ranks all skip the collective
    if group is None:
        _warn_if_parallel(module)
    _step_biases(routers, rate, group)


def _step_biases(routers: list[Router], rate: float, group: dist.ProcessGroup | None) -> None:
    """Sum the counters over ``group`` (one ``all_reduce``; none without a group) and move each
    router's bias by ``rate``."""
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
                stacklevel=3,
            )
        router.expert_bias.add_(delta_E.to(router.expert_bias.dtype))
        router.reset_counters()
        router.forwards_since_bias_update = 0  # Note [Expert bias needs its update]


def set_aux_loss_group(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the ``"global_batch"`` balance-loss statistics of every router in ``module`` over
    ``group`` (``None``: back to this rank's batch; Note [Router loss shares] in ``losses.py``).

    ``group`` must hold every rank that routes tokens of the global batch, each token on
    exactly one of them (the dense mesh's dp x tp ranks: ``meshes.stage_group`` for the meshes
    of :func:`~dtensor_moe.build_moe_meshes`, the default group when ``pp == 1``; under
    pipeline parallelism the statistics are then those of one micro-batch), and every rank of
    it must run each training forward. Each forward then runs one
    ``all_reduce`` of ``2 * E + 2`` floats over ``group`` (in place of the one over tp under
    token parallelism). Configuration, like the parallel styles: call it once, before
    training, on every rank.

    Raises:
        ValueError: when ``module`` holds no router with ``aux_loss_type="global_batch"``, or
            ``group`` holds a rank outside the pipeline stage that ``parallelize_moe`` recorded
            on one of them (Note [A router knows its stage]); both locally, with no
            collective.
    """
    routers = [
        m
        for m in module.modules()
        if is_router(m) and m.loss_settings.aux_loss_type == "global_batch"
    ]
    if not routers:
        raise ValueError(
            f"set_aux_loss_group found no router with aux_loss_type='global_batch' in "
            f"{type(module).__name__}; build the MoE layers with "
            "MoEConfig(aux_loss_type='global_batch', aux_loss_coeff=...)"
        )
    fix = "Pass group=meshes.stage_group (the group parallelize_moe sets)"
    check_group_in_stage(routers, group, "set_aux_loss_group", fix)
    for router in routers:
        router.aux_loss_group = group
