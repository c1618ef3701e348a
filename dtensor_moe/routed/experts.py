"""The routed experts: the plan that runs them, chosen once, and the module that holds their
weights.

Shape legend:
    T  tokens routed by this rank
    K  experts per token
    E  routed experts; e  experts whose weights this rank holds
    D  model width        H  hidden width of one expert
    S  rows of a source (``x_TD``, or the rows an exchange received)
    R  rows of the routed buffer, grouped by local expert (padding included)

Note [Grouped experts on local weights]: the expert math (``kernels.py``) takes plain tensors.
:meth:`GroupedExperts.forward` reads the weights once per forward, through
:meth:`GroupedExperts.local_weights`, and hands them to every step of the plan; DTensor weights
become their local ``e`` experts there, and no parallel style wraps the math.

Note [Expert weights as DTensors]: a parallel style may turn ``w1``/``w2``/``w3`` into DTensors;
the experts then run on their local shards (:func:`local_expert_weight`). The gradient
placements are derived from the weight's own placements, never written per call: on a mesh dim
where the weight is sharded (``Shard(0)`` over experts, ``Shard(1)``/``Shard(2)`` over the
hidden dim), the local gradient is the whole gradient of the local shard, because every routed
row that uses the shard reaches it (through the exchange, or because the tokens are the same on
every rank of that dim); so the gradient keeps the placement. On a mesh dim where the weight is
``Replicate``, the ranks route different tokens, so the local gradient is a partial sum over
that dim: ``Partial``. A ``Partial`` weight is an error.

Note [One plan]
~~~~~~~~~~~~~~~
A :class:`RoutedPlan` is a frozen value made when ``GroupedExperts`` is built and made again
when a parallel style puts it on a mesh. It fixes:

* ``kernel``: the compute path (``auto``, ``grouped_mm``, ``loop``, ``bmm``);
* ``memory``: ``two_step`` (the routed SwiGLU in two steps, keeping ``h1``/``h3``: Note [The
  routed SwiGLU in two steps] in ``kernels.py``) or ``plain`` (plain autograd on the same
  math), and ``recompute``: keep only the rows' source and run the experts again in backward;
* where the combine weights apply (``exchange.score_before_experts``: on the rows before the
  experts; otherwise inside them, on the narrower side of the down projection);
* the exchange backend, with its overlap of the own rows (Note [Exchange protocol] in
  ``exchange.py``).

Per forward only the data and the autograd context decide, all in :func:`choose_step`: no rows
here; ``auto`` taking ``bmm`` when every expert has the same host count (or ``loop`` where
``torch._grouped_mm`` does not take the dtype or the row alignment); and the two-step
strategy, a formula of our own, falls back to plain autograd where it cannot run (gradients
off, ``torch.func`` transforms, a path other than ``grouped_mm``, scores before the experts).
:func:`start` and :func:`finish` then run the chosen :data:`Step`, which a caller may hold apart
(the own rows' up projections run while the other rows travel).
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from dtensor_moe import _compat
from dtensor_moe.moe.config import ComputePath, DeviceLike, autocast_off, factory_kwargs
from dtensor_moe.routed.exchange import TokenExchange
from dtensor_moe.routed.kernels import (
    _group_ends,
    _grouped_mm_supported,
    _host_counts,
    _project_up,
    _routed_swiglu,
    _swiglu_grouped_mm,
    _swiglu_on_path,
    resolve_compute_path,
    swiglu_down,
)
from dtensor_moe.routed.layouts import (
    Capacity,
    DeviceCounts,
    ExpertLayout,
    permute_tokens,
    scores_in_rows,
)
from dtensor_moe.routed.local import LocalExchange

__all__ = [
    "GroupedExperts",
    "Memory",
    "RoutedPlan",
    "Started",
    "Step",
    "choose_step",
    "compute",
    "finish",
    "local_expert_weight",
    "start",
]

Memory: TypeAlias = Literal["two_step", "plain"]
Step: TypeAlias = Literal["no_rows", "two_step", "recompute_two_step", "plain", "recompute_plain"]
Weights: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class RoutedPlan:
    """How the routed rows are exchanged and computed (Note [One plan])."""

    kernel: ComputePath
    memory: Memory
    recompute: bool
    exchange: TokenExchange

    def __post_init__(self) -> None:
        if self.kernel not in ("auto", "grouped_mm", "loop", "bmm"):
            raise ValueError(
                f"unknown compute path {self.kernel!r}; use auto, grouped_mm, loop or bmm"
            )
        if self.memory not in ("two_step", "plain") or not isinstance(self.recompute, bool):
            raise ValueError(
                f"RoutedPlan: memory must be 'two_step' or 'plain' and recompute a bool, got "
                f"memory={self.memory!r}, recompute={self.recompute!r}"
            )
        if not isinstance(self.exchange, TokenExchange):
            raise TypeError(f"RoutedPlan: exchange must be a TokenExchange, got {self.exchange!r}")

    def with_exchange(self, exchange: TokenExchange) -> RoutedPlan:
        """This plan with another exchange (what a parallel style installs)."""
        return dataclasses.replace(self, exchange=exchange)

    def runs_eagerly(
        self, x_TD: torch.Tensor, w1_eHD: torch.Tensor, capacity: Capacity | None
    ) -> bool:
        """Whether a forward under this plan reads counts or exchange sizes on the host, so
        that an MoE under ``torch.compile`` runs the routed experts eagerly, as its one island
        (Note [Eager islands under torch.compile] in ``moe/layer.py``): the exchange says so,
        or the kernel is ``loop``/``bmm`` (forced, or ``auto`` where ``torch._grouped_mm`` does
        not take the dtype or the row alignment)."""
        if self.exchange.reads_host_sizes(capacity):
            return True
        grouped = self.kernel in ("auto", "grouped_mm")
        return not (grouped and _grouped_mm_supported(x_TD, w1_eHD))


@dataclass(frozen=True, slots=True)
class Started:
    """What :func:`start` hands to :func:`finish`: the chosen step and kernel, the counts if
    they were read on the host (once per forward), the rows' source and layout, each row's
    combine weight (``None``: unscaled), and what the step ran first: the gathered rows (plain
    steps) or the two-step's up projections ``(h1, h3, offs)``."""

    step: Step
    kernel: str
    counts: list[int] | None
    source: torch.Tensor
    layout: ExpertLayout
    scores_R: torch.Tensor | None
    rows: torch.Tensor | None = None
    up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def choose_step(
    plan: RoutedPlan, layout: ExpertLayout, w1_eHD: torch.Tensor
) -> tuple[Step, str, list[int] | None]:
    """Every per-forward decision of the routed path (Note [One plan]): the step, the concrete
    kernel for these rows (which have the weights' dtype and device: ``GroupedExperts.forward``
    checks), and the counts if they had to be read on the host (once)."""
    if layout.num_rows == 0:
        return "no_rows", "", None
    if w1_eHD.shape[0] != layout.counts_e.numel():
        raise ValueError(
            f"counts_e has {layout.counts_e.numel()} entries but the weights hold "
            f"{w1_eHD.shape[0]} experts"
        )
    on_device = isinstance(layout, DeviceCounts)  # a fixed buffer: never read on the host
    counts = None if on_device else _host_counts(layout.counts_e, plan.kernel)
    kernel = resolve_compute_path(plan.kernel, w1_eHD, w1_eHD, counts)
    if kernel != "grouped_mm" and on_device:
        raise ValueError(
            f"the {plan.exchange.name!r} exchange keeps its counts on the device, which the "
            f"{kernel!r} compute path reads on the host; use compute_path='auto' or "
            "'grouped_mm' (bfloat16 or float32, rows of a multiple of 16 bytes)"
        )
    if kernel != "grouped_mm" and counts is None:  # loop and bmm need them
        counts = layout.counts_e.tolist()
    grad = torch.is_grad_enabled()
    two_step = (
        plan.memory == "two_step"
        and kernel == "grouped_mm"
        and not plan.exchange.score_before_experts
        and grad
        and not _compat.functorch_active()  # which runs no custom formula or saved-tensor hook
    )
    if two_step:
        return ("recompute_two_step" if plan.recompute else "two_step"), kernel, counts
    if plan.recompute and grad and not torch.compiler.is_compiling():
        return "recompute_plain", kernel, counts
    return "plain", kernel, counts


def start(
    plan: RoutedPlan,
    source_SD: torch.Tensor,
    scores: torch.Tensor | None,
    layout: ExpertLayout,
    weights: Weights,
    *,
    keep_rows: bool = False,
) -> Started:
    """Choose the step for these rows and run what comes first: the two-step's up
    projections (step 1 of Note [The routed SwiGLU in two steps]), or the rows' gather.

    ``scores``: each pair's combine weight (indexed by the layout's ``order_N``; in row order
    for an :class:`~dtensor_moe.routed.layouts.InOrder` layout), or ``None``: unscaled.
    ``keep_rows``: keep the gathered rows for backward rather than gather them again (when
    nothing else keeps the source, as for an exchange's received rows)."""
    w1, _, w3 = weights
    step, kernel, counts = choose_step(plan, layout, w1)
    scores_R = None if scores is None else scores_in_rows(scores, layout)
    if step == "recompute_two_step":  # the checkpoint gathers the rows itself
        return Started(step, kernel, counts, source_SD, layout, scores_R)
    rows_RD = permute_tokens(source_SD, layout)
    if step != "two_step":
        if plan.exchange.score_before_experts and scores_R is not None:
            rows_RD, scores_R = rows_RD * scores_R.unsqueeze(-1), None  # before the experts
        return Started(step, kernel, counts, source_SD, layout, scores_R, rows=rows_RD)
    offs_e = _group_ends(layout.counts_e.to(w1.device))
    regather = not keep_rows and not torch.compiler.is_compiling()  # compiled: the partitioner's
    up = _project_up(rows_RD, source_SD, layout, w1, w3, offs_e, regather)
    return Started(step, kernel, counts, source_SD, layout, scores_R, up=(*up, offs_e))


def finish(started: Started, weights: Weights) -> torch.Tensor:
    """The rest of the chosen step: ``out_RD``, in the layout's row order (padding rows zero),
    each row scaled by its combine weight (at the down projection, as ``swiglu_down``)."""
    w1, w2, w3 = weights
    step, layout, scores_R = started.step, started.layout, started.scores_R
    if step == "two_step":
        h1_RH, h3_RH, offs_e = started.up
        return swiglu_down(h1_RH, h3_RH, w2, offs_e, scores_R)
    if step == "recompute_two_step":
        offs_e = _group_ends(layout.counts_e.to(w1.device))
        return torch.utils.checkpoint.checkpoint(
            _routed_swiglu, started.source, layout, w1, w2, w3, offs_e, scores_R,
            use_reentrant=False,
        )  # fmt: skip
    if step == "no_rows":  # no rows here (no tokens, or all sent away): zero rows, still in
        out_RD = started.rows  # the graph of the source, the scores and the weights, as on
        if scores_R is not None:  # every rank
            out_RD = out_RD * scores_R.unsqueeze(-1)
        return out_RD + 0 * (w1.sum() + w2.sum() + w3.sum())
    rows_RD, counts_e = started.rows, layout.counts_e
    if started.kernel == "grouped_mm":  # its counts stay where they are
        run, args = _swiglu_grouped_mm, (rows_RD, w1, w2, w3, counts_e, scores_R)
    else:
        run = _swiglu_on_path
        args = (rows_RD, w1, w2, w3, counts_e, started.kernel, scores_R, started.counts)
    if step == "recompute_plain":
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    return run(*args)


def compute(
    plan: RoutedPlan,
    source_SD: torch.Tensor,
    scores: torch.Tensor | None,
    layout: ExpertLayout,
    weights: Weights,
    *,
    keep_rows: bool = False,
) -> torch.Tensor:
    """:func:`start` then :func:`finish`: the rows of ``layout`` through their experts."""
    return finish(start(plan, source_SD, scores, layout, weights, keep_rows=keep_rows), weights)



class GroupedExperts(nn.Module):
    """Routed SwiGLU experts with stacked weights, run by their :class:`RoutedPlan`.

    Keyword Args:
        dim: ``D``.
        hidden_dim: ``H`` of each expert.
        num_experts: ``E``.
        compute_path: the plan's kernel; see :func:`~dtensor_moe.routed.grouped_swiglu`.
        recompute_experts: keep only the experts' input for backward and recompute the rest
            there (Note [What the experts save for backward] in ``kernels.py``).
        fused_routed_step: on the ``grouped_mm`` path, keep less for backward (the plan's
            ``two_step`` memory; Note [The routed SwiGLU in two steps]); ``False``: plain
            autograd (``plain``), which also supports a second backward. Both give the same
            outputs and gradients up to float rounding.
        exchange: a :class:`~dtensor_moe.routed.TokenExchange` (default: the local one, no
            padding, scores inside the experts). Parallel styles replace it, by name.
        init_std: std of the normal weight initialisation.
        device, dtype: where and in which floating dtype the weights are made (torch's factory
            arguments; ``None``: torch's defaults).

    Forward: ``(x_TD, topk_scores_TK, topk_ids_TK, counts_E) -> y_TD``. The collectives are
    the exchange's; this module adds none.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        compute_path: ComputePath = "auto",
        exchange: TokenExchange | None = None,
        init_std: float = 0.02,
        recompute_experts: bool = False,
        fused_routed_step: bool = True,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = factory_kwargs(device, dtype)
        if not isinstance(recompute_experts, bool):
            raise TypeError(f"recompute_experts must be a bool, got {recompute_experts!r}")
        if not isinstance(fused_routed_step, bool):
            raise TypeError(f"fused_routed_step must be a bool, got {fused_routed_step!r}")
        self.plan = RoutedPlan(
            kernel=compute_path,
            memory="two_step" if fused_routed_step else "plain",
            recompute=recompute_experts,
            exchange=exchange if exchange is not None else LocalExchange(num_experts=num_experts),
        )
        self.init_std = init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.reset_parameters()

    @property
    def exchange(self) -> TokenExchange:
        """The plan's exchange backend."""
        return self.plan.exchange

    @property
    def compute_path(self) -> ComputePath:
        return self.plan.kernel

    @property
    def recompute_experts(self) -> bool:
        return self.plan.recompute

    @property
    def fused_routed_step(self) -> bool:
        return self.plan.memory == "two_step"

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=self.init_std)

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> torch.Tensor:
        """Dispatch, compute, combine: the routed path of every layout.

        The rows this rank routes to its own experts start (their up projections) while the
        other rows travel, and finish while the outputs travel back; autograd's order runs
        their backward while the output gradients travel (Note [Exchanges as autograd pairs]
        in ``all_to_all.py``).
        """
        if x_TD.dtype != self.w1.dtype:  # after this module's own hooks (an FSDP unit's cast)
            raise ValueError(
                f"the routed experts got input of dtype={x_TD.dtype} but their weights are "
                f"{self.w1.dtype}; cast the input or the layer so that they match (for "
                "example moe.to(torch.bfloat16)). torch.autocast does not apply to the routed "
                "experts: they run in the weights' dtype, and need an input of it"
            )
        plan, exchange = self.plan, self.plan.exchange
        with autocast_off(self.w1):  # Note [Routed experts under autocast] in kernels.py
            exchange.check_routing(x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
            scores_TK = topk_scores_TK.to(x_TD.dtype)
            routed = exchange.sort_and_send(x_TD, scores_TK, topk_ids_TK, counts_E, capacity)
            weights = self.local_weights()
            own = start(plan, routed.source, routed.scores, routed.layout, weights)
            received = exchange.receive(routed)  # None: nothing was sent here
            returning = None
            if received is not None:  # nothing else keeps the received rows: keep_rows
                out_RD = compute(plan, received.rows, received.scores, received.layout,
                                 weights, keep_rows=True)  # fmt: skip
                returning = exchange.send_back(out_RD, routed)
            return exchange.combine(finish(own, weights), routed, returning)

    def runs_eagerly_under_compile(
        self, x_TD: torch.Tensor, capacity: Capacity | None = None
    ) -> bool:
        """Whether :meth:`forward` reads counts or exchange sizes on the host, so that an
        :class:`~dtensor_moe.moe.MoE` under ``torch.compile`` calls it eagerly, as its one
        island (:meth:`RoutedPlan.runs_eagerly`)."""
        return self.plan.runs_eagerly(x_TD, local_expert_weight(self.w1), capacity)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w2, w3)`` as plain tensors: the local shards of DTensor weights. See Note
        [Expert weights as DTensors]."""
        ws = (self.w1, self.w2, self.w3)
        if all(isinstance(w, DTensor) for w in ws):
            for w in ws:
                _check_not_partial(w)
            return _compat.local_views(ws, tuple(_grad_placements(w) for w in ws))
        w1, w2, w3 = (local_expert_weight(w) for w in ws)
        return w1, w2, w3

    def extra_repr(self) -> str:
        E, H, D = self.w1.shape
        plan = self.plan
        return (
            f"num_experts={E}, dim={D}, hidden_dim={H}, compute_path={plan.kernel!r}, "
            f"recompute_experts={plan.recompute}, "
            f"fused_routed_step={plan.memory == 'two_step'}, exchange={plan.exchange!r}"
        )


def local_expert_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, or the local shard of a DTensor ``w`` with derived gradient placements.

    See Note [Expert weights as DTensors]. No collective runs in forward or in backward.
    """
    if not isinstance(w, DTensor):
        return w
    _check_not_partial(w)
    return w.to_local(grad_placements=list(_grad_placements(w)))


def _check_not_partial(w: DTensor) -> None:
    if any(p.is_partial() for p in w.placements):
        raise ValueError(
            f"routed expert weights must be Shard or Replicate DTensors, got {w.placements}; "
            "redistribute the weight or re-apply the parallel style"
        )


def _grad_placements(w: DTensor) -> tuple:
    """See Note [Expert weights as DTensors]: ``Replicate`` dims give ``Partial`` gradients."""
    return tuple(Partial() if p.is_replicate() else p for p in w.placements)
