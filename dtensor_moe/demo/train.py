"""The training loop, shared by the distributed run and its single-process reruns.

Shape legend:
    B  sequences on this rank, L  tokens per sequence, V  vocabulary
    M  MoE layers, E  routed experts per layer

One step, on every rank (Note [Demo step]):

1. draw the global batch of this step and keep this rank's data-parallel slice;
2. forward inside ``collect_aux_losses()``, cross-entropy (mean over this rank's tokens) plus
   the collected auxiliary losses (none unless ``aux_loss_coeff > 0``; Note [Auxiliary loss
   follows the loss] in ``dtensor_moe/moe/balance.py``), backward. FSDP2 averages the grads
   over dp, so they are the grads of the mean loss over the global batch. With
   ``--exchange fixed`` the forward and backward run through ``step_without_overflow`` (or
   are followed by ``check_exchanges``), and the buffer factor the step needed is read
   (Note [Demo fixed exchange]);
3. ``dtensor_moe.clip_grad_norm_(model.parameters(), max_norm)``: one call, whatever meshes the
   params live on; it returns the global norm before clipping;
4. read the router counters (tokens per expert since the last step), summed over all ranks:
   :func:`dtensor_moe.moe.load_stats`, one all-reduce for every layer;
5. the optimizer step: one fused ``AdamW.step()`` over every param, or with ``--optimizer muon``
   :class:`dtensor_moe.optim.Muon` over the hidden matrices and routed experts and a fused
   AdamW over the rest (:func:`build_optimizers`);
6. ``update_expert_bias`` (aux-loss-free balancing) or, with ``--no-balance``, reset the
   counters.

The single-process rerun calls the same function with ``group=None``: same seed, same initial
weights, same global batches, so its losses must match the distributed ones.

Under pipeline parallelism (``--pp``) step 2 is one ``schedule.step`` of
:class:`~dtensor_moe.demo.pipeline.Pipeline` over this pipeline's rows, the clip also reduces over
``pp_mesh``, and the counters and the bias update are per stage (``meshes=``). The rerun then
accumulates the same global micro-batches: micro-batch ``m`` is the ``m``-th micro-batch of
every pipeline, and each one's loss is divided by their number before its backward
(Note [Demo pipeline] in ``pipeline.py``).
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dtensor_moe
from dtensor_moe.demo.config import DemoConfig
from dtensor_moe.demo.data import MarkovChain
from dtensor_moe.demo.model import ModelConfig, MoETransformer
from dtensor_moe.moe import LayerLoad, Router, load_stats, update_expert_bias
from dtensor_moe.moe.protocol import is_router
from dtensor_moe.routed import (
    FixedBufferExchange,
    check_exchanges,
    needed_buffer_factor,
    reset_overflow,
    step_without_overflow,
)
from dtensor_moe import collect_aux_losses

if TYPE_CHECKING:
    from dtensor_moe.demo.pipeline import Pipeline

__all__ = [
    "BufferOverflow",
    "FixedStepStats",
    "StepRecord",
    "build_model",
    "build_optimizers",
    "dynamo_graphs",
    "optimizer_line",
    "microbatch_rows",
    "run_single_process",
    "run_single_process_with_params",
    "train",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """What one step reports (global values, equal on every rank)."""

    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float
    imbalance: float
    expert_load: list[list[float]]  # (M, E): share of the routed tokens each expert received
    load: tuple[LayerLoad, ...] = ()  # per MoE layer: tokens per expert this step, all ranks
    # --exchange fixed (the distributed run only; None otherwise), Note [Demo fixed exchange]:
    needed_buffer_factor: float | None = None  # the factor this step's fullest rank pair needed
    reruns: int | None = None  # extra runs of the step's forward + backward (--overflow rerun)
    max_rows_per_pair: int | None = None  # the most rows one rank sent one rank, in one forward
    buffer_factor: float | None = None  # the factor in effect at the end of the step
    rows_per_pair: int | None = None  # C: the buffer's rows per rank pair at that factor
    # --compile (the distributed run only): the frames dynamo compiled during this step, on
    # this rank (torch._dynamo.utils.counters["frames"]["total"]); after the first step, any
    # is a recompile
    compiled_frames: int | None = None


class BufferOverflow(RuntimeError):
    """``--exchange fixed``: rows did not fit the buffers (``--overflow strict``), or still did
    not after the reruns of ``step_without_overflow``. Raised on every rank alike."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedStepStats:
    """What one step of ``--exchange fixed`` reports; see Note [Demo fixed exchange]."""

    needed_buffer_factor: float
    reruns: int
    max_rows_per_pair: int
    buffer_factor: float
    rows_per_pair: int


# Note [Demo fixed exchange]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# With --exchange fixed, the step's forward and backward (one schedule step under --pp) run
# through ``step_without_overflow`` (--overflow rerun: run again with a 1.5x larger factor,
# kept for the later steps, until no rank overflowed) or are followed by ``check_exchanges``
# (--overflow strict: stop), both before the clip and the optimizer step, so no optimizer sees
# an overflowed run. Then ``needed_buffer_factor`` (one all-reduce, the same on every rank)
# is read once per step and the records are reset. ``max_rows_per_pair`` is that factor times
# ``N / P`` (``N``: the rows one rank hands the exchange per forward, ``config.routed_pairs``;
# ``P``: its ranks, ``config.ep_ranks``), rounded: the exchange records ``rows * P / N`` in
# float32, whose rounding error is far below half a row. The first step checks that every
# fixed exchange of the model has ``P`` ranks and the buffer ``N`` gives, so ``N`` and ``P``
# are the exchange's own. benchmarks/fixed_overflow.py decides from ``max_rows_per_pair``
# which steps overflow at which factor.


def _fixed_exchanges(model: nn.Module) -> list[FixedBufferExchange]:
    exchanges = (getattr(getattr(m, "plan", None), "exchange", None) for m in model.modules())
    return [ex for ex in exchanges if isinstance(ex, FixedBufferExchange)]


def _check_fixed_sizes(model: nn.Module, config: DemoConfig) -> None:
    """Every fixed exchange spans ``config.ep_ranks`` ranks and last ran a forward of
    ``config.routed_pairs`` rows (its buffer is the one they give)."""
    N, P = config.routed_pairs, config.ep_ranks
    exchanges = _fixed_exchanges(model)
    if not exchanges:
        raise RuntimeError("--exchange fixed: the model holds no fixed exchange")
    for ex in exchanges:
        if ex.mesh.size() != P or ex.last_rows_per_pair != ex.rows_per_pair(N):
            raise RuntimeError(
                f"--exchange fixed: the demo expected {N} rows per forward over {P} ranks "
                f"(a buffer of {ex.rows_per_pair(N)} rows per pair), but an exchange spans "
                f"{ex.mesh.size()} ranks with {ex.last_rows_per_pair} rows per pair"
            )


def _fixed_step(model: nn.Module, run: Callable[[], object], config: DemoConfig, step: int):
    """Run ``run`` (forward and backward) under ``config.overflow``; its result and the step's
    :class:`FixedStepStats`. See Note [Demo fixed exchange]."""
    runs = failed_inside = 0

    def counted() -> object:
        nonlocal runs, failed_inside
        runs += 1
        try:
            return run()
        except BaseException:
            failed_inside = 1
            raise

    try:
        if config.overflow == "rerun":
            out = step_without_overflow(model, counted)
        else:
            out = counted()
    except RuntimeError as err:
        if failed_inside:  # the forward or backward itself failed: not an overflow
            raise
        raise BufferOverflow(
            f"step {step + 1}: {err}; rerun the demo with a larger --buffer-factor (given: "
            f"{config.buffer_factor:g})"
        ) from None
    needed = needed_buffer_factor(model)  # one all-reduce: the same on every rank
    if config.overflow == "strict":
        try:
            check_exchanges(model)  # one all-reduce; resets the records
        except RuntimeError as err:
            enough = math.ceil(needed * 100) / 100  # C(F) >= F * N / P: F >= needed holds it
            raise BufferOverflow(
                f"step {step + 1} overflowed under --overflow strict: {err}. In the demo: "
                f"this step needed --buffer-factor {enough:.2f} or more (given: "
                f"{config.buffer_factor:g}); rerun with it, or with --overflow rerun"
            ) from None
    else:
        reset_overflow(model)
    if step == 0:
        _check_fixed_sizes(model, config)
    exchanges = _fixed_exchanges(model)
    stats = FixedStepStats(
        needed_buffer_factor=needed,
        reruns=runs - 1,
        max_rows_per_pair=round(needed * config.routed_pairs / config.ep_ranks),
        buffer_factor=max(ex.buffer_factor for ex in exchanges),
        rows_per_pair=max(ex.last_rows_per_pair for ex in exchanges),
    )
    return out, stats


def build_model(config: ModelConfig, seed: int) -> MoETransformer:
    """The model with the weights of ``seed``: the same in every process."""
    torch.manual_seed(seed)
    return MoETransformer(config)


def build_optimizers(model: nn.Module, config: DemoConfig) -> list[torch.optim.Optimizer]:
    """The optimizers of ``config.optimizer`` over ``model``'s params.

    ``"adamw"``: one fused AdamW. ``"muon"``: the recipe of docs/optimizers.md (Muon):
    :class:`~dtensor_moe.optim.Muon` with ``adjust_lr_fn="match_rms_adamw"`` at ``config.lr``
    for the params :func:`~dtensor_moe.optim.muon_param_groups` picks, and a fused AdamW at the
    same lr for the others. Newton-Schulz runs in float32 (``ns_dtype``): on a CPU it is many
    times faster than bfloat16, and the parity proof needs the distributed run and its rerun to
    differ by float32 rounding only; torch's bfloat16 iteration turns the last-bit differences
    of the grads into bfloat16 ones, which then decide a near-tied routing within a few dozen
    steps.
    """
    if config.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=config.lr, fused=True)]
    groups = dtensor_moe.optim.muon_param_groups(model)
    muon = dtensor_moe.optim.Muon(
        groups.muon, lr=config.lr, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32
    )
    return [muon, torch.optim.AdamW(groups.adamw, lr=config.lr, fused=True)]


def optimizer_line(config: DemoConfig) -> str:
    """How the demo steps, in words, for its header."""
    if config.optimizer == "adamw":
        return "one fused AdamW over all params"
    return (
        "dtensor_moe.optim.Muon (match_rms_adamw, float32 Newton-Schulz) over the hidden "
        "matrices and routed experts, fused AdamW over the rest"
    )


def _routers(model: nn.Module) -> list[Router]:
    return [m for m in model.modules() if is_router(m)]


def _load(
    model: nn.Module, group: dist.ProcessGroup | None, pipeline: Pipeline | None
) -> tuple[LayerLoad, ...]:
    """Tokens routed to each expert of each layer this step, summed over ``group``.

    Every token is counted by exactly one rank (Note [Global router statistics] in
    ``dtensor_moe/parallel/token_parallel.py``), so the sum is the global count. The
    single-process rerun (``group=None``) runs inside the distributed job: "local" then. Under
    pipeline parallelism every stage's layers come to every rank, sorted by layer index.
    """
    if pipeline is not None:
        layers = load_stats(list(model), meshes=pipeline.meshes)
        return tuple(sorted(layers, key=lambda layer: int(layer.name.split(".")[1])))
    return tuple(load_stats(model, process_group=group if group is not None else "local"))


def microbatch_rows(config: DemoConfig) -> list[torch.Tensor]:
    """Rows of the global batch in each global micro-batch: micro-batch ``m`` of every pipeline.

    Pipeline ``d`` (dp rank ``d`` of every stage) takes rows ``d * batch / dp`` onwards, and the
    schedule splits them into ``config.microbatches`` consecutive chunks.
    """
    local, size = config.batch // config.dp, config.microbatch_size
    return [
        torch.cat([torch.arange(size) + d * local + m * size for d in range(config.dp)])
        for m in range(config.microbatches)
    ]


def _forward_backward(
    model: nn.Module, inputs_BL: torch.Tensor, targets_BL: torch.Tensor, config: DemoConfig
) -> torch.Tensor:
    """Forward and backward in this process; returns the cross-entropy (without router losses).

    Without ``--pp``: the whole batch at once. With it (the single-process rerun only): the
    global micro-batches of :func:`microbatch_rows`, each loss divided by their number.
    """
    if config.pp == 1:
        with collect_aux_losses() as aux:
            logits_BLV = model(inputs_BL)
        loss = F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())
        (loss + aux.total()).backward()  # the reported loss is the cross-entropy alone
        return loss
    losses = []
    for rows in microbatch_rows(config):
        with collect_aux_losses() as aux:
            logits_BLV = model(inputs_BL[rows])
        loss = F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL[rows].flatten())
        ((loss + aux.total()) / config.microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _dynamo_frames() -> int:
    """Frames torch.compile (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def dynamo_graphs() -> tuple[int, int]:
    """``(graphs, graph breaks)`` dynamo has made in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _imbalance(counts_ME: torch.Tensor) -> float:
    """Max over mean tokens per expert, averaged over layers (1.0 is perfectly balanced)."""
    mean_M = counts_ME.mean(dim=-1).clamp_min(1e-12)
    return float((counts_ME.max(dim=-1).values / mean_M).mean())


def _global_mean(value: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    value = value.detach().clone().to(torch.float64)
    if group is not None:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return float(value)


def train(
    model: nn.Module,
    config: DemoConfig,
    chain: MarkovChain,
    *,
    dp_rank: int,
    dp_size: int,
    group: dist.ProcessGroup | None,
    on_step: Callable[[StepRecord], None] | None = None,
    pipeline: Pipeline | None = None,
) -> list[StepRecord]:
    """Train ``model`` for ``config.steps`` steps; see Note [Demo step] in this module.

    ``group`` is the process group of all ranks (``None`` in a single process): the loss and the
    expert counters are reduced over it, and so is the expert-bias update. With ``pipeline``,
    ``model`` is an ``nn.ModuleList`` of this rank's stage modules, and ``pipeline`` runs the
    forward and backward of every micro-batch.
    """
    opts = build_optimizers(model, config)
    balance = any(router.expert_bias is not None for router in _routers(model))
    local_batch = config.batch // dp_size
    records = []
    compiled = config.compile and group is not None  # the reruns stay eager
    for step in range(config.steps):
        start = time.perf_counter()
        frames = _dynamo_frames() if compiled else None
        inputs_BL, targets_BL = chain.batch(step, config.batch, config.seq_len)
        rows = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
        if pipeline is None:
            run = functools.partial(
                _forward_backward, model, inputs_BL[rows], targets_BL[rows], config
            )
            pp_mesh = None
        else:
            run = functools.partial(pipeline.step, inputs_BL[rows], targets_BL[rows])
            pp_mesh = pipeline.meshes.pp_mesh
        fixed = None
        if config.fixed and group is not None:  # the single-process reruns exchange nothing
            loss, fixed = _fixed_step(model, run, config, step)
        else:
            loss = run()
        grad_norm = dtensor_moe.clip_grad_norm_(
            model.parameters(), config.max_norm, pp_mesh=pp_mesh
        )
        load = _load(model, group, pipeline)
        counts_ME = torch.tensor([layer.counts for layer in load], dtype=torch.float64)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if balance and pipeline is not None:
            update_expert_bias(model, config.bias_rate, meshes=pipeline.meshes)
        elif balance:
            update_expert_bias(model, config.bias_rate, process_group=group)
        else:
            for router in _routers(model):
                router.reset_counters()
        record = StepRecord(
            step=step + 1,
            loss=_global_mean(loss, group) if pipeline is None else pipeline.global_loss(loss),
            grad_norm=float(grad_norm),
            tokens_per_s=config.tokens_per_step / (time.perf_counter() - start),
            imbalance=_imbalance(counts_ME),
            expert_load=(counts_ME / counts_ME.sum(dim=-1, keepdim=True)).tolist(),
            load=load,
            **({} if fixed is None else dataclasses.asdict(fixed)),
            compiled_frames=None if frames is None else _dynamo_frames() - frames,
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


def run_single_process(
    config: DemoConfig, chain: MarkovChain, *, balance: bool
) -> list[StepRecord]:
    """The same steps in this process alone, on plain tensors: the parity reference.

    ``balance`` switches the expert bias on or off; the initial weights do not depend on it.
    """
    return run_single_process_with_params(config, chain, balance=balance)[0]


def run_single_process_with_params(
    config: DemoConfig, chain: MarkovChain, *, balance: bool
) -> tuple[list[StepRecord], dict[str, torch.Tensor]]:
    """:func:`run_single_process`, and the params after the last step, by name."""
    moe = dataclasses.replace(config.model.moe, use_expert_bias=balance)
    model = build_model(dataclasses.replace(config.model, moe=moe), config.seed)
    records = train(model, config, chain, dp_rank=0, dp_size=1, group=None)
    return records, {name: p.detach() for name, p in model.named_parameters()}
