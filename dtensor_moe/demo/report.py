"""What rank 0 prints and writes: progress lines, the summary, metrics.json and training.png."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from dtensor_moe.demo.config import DemoConfig
from dtensor_moe.demo.train import StepRecord

__all__ = [
    "PARAM_TOLERANCE",
    "PARITY_TOLERANCE",
    "Summary",
    "load_lines",
    "progress_line",
    "summarize",
    "summary_lines",
    "write_outputs",
]

# Note [Demo parity]
# ~~~~~~~~~~~~~~~~~
# The demo passes only when both hold:
# - every requested step was compared: the distributed run and its single-process rerun sent the
#   same number of tokens to every expert in every layer at every step. Loss differences after
#   the routing diverges say nothing, so a divergence fails the run (it may be a near-tie, see
#   Note [Decisive routing] in model.py, or a parallelism bug) rather than shortening the check;
# - the largest absolute |loss difference| over those steps is at most PARITY_TOLERANCE.
# Both runs are fp32 with the same weights and batches; they differ only in the order of
# floating-point sums (sharded matmuls, reduce-scatters, all-to-alls). Measured over 100 steps
# on 4 processes: 2e-7 to 1.6e-6 in every layout tried (EP borrowing tp, EP x TP, expert TP only,
# dp2ep, tp 4, no SP, --seq-len 13 and 1), for losses between 1.3 and 4.7. The tolerance is
# absolute, about 6 times the largest difference seen.
PARITY_TOLERANCE = 1e-5
# Under --pp the rerun accumulates the same micro-batches, and parity also needs every element of
# every param after the last step within PARAM_TOLERANCE (absolute). AdamW divides each
# element's step by its own grad history, so an element with tiny grads (an expert that few
# tokens reached) turns rounding differences into larger param differences than the loss shows:
# measured on 8 processes, 1.2e-6 to 1.7e-6 after the default 100 steps (1f1b, gpipe,
# interleaved with --layers 4) and up to 6.1e-6 after 30 steps at --dim 32 (--no-sp,
# --expert-tp, --ep 1, --pp 4, --seq-len 1 ...), for params up to about 3 in size. A param
# that missed one update would differ by about --lr (3e-3).
PARAM_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """The end-of-run comparisons that the summary prints and metrics.json keeps."""

    max_loss_diff: float
    max_grad_norm_diff: float
    routing_diverged_at: int | None
    compared_steps: int
    parity_ok: bool
    imbalance_balanced: float | None
    imbalance_unbalanced: float | None
    final_loss: float
    entropy_rate: float
    max_param_diff: float | None = None  # under --pp: every param after the last step
    # --exchange fixed: the largest factor a step needed (and the first step that needed it),
    # the steps whose forward + backward ran again, and the extra runs in all
    max_needed_buffer_factor: float | None = None
    max_needed_at: int | None = None
    overflowed_steps: list[int] | None = None
    reruns: int | None = None
    final_buffer_factor: float | None = None
    final_rows_per_pair: int | None = None
    # --compile: rank 0's dynamo counters after the distributed run, and the frames compiled
    # at step 1 and at each later step that compiled any (a recompile)
    dynamo_graphs: int | None = None
    dynamo_graph_breaks: int | None = None
    first_step_frames: int | None = None
    recompiles: dict[int, int] | None = None


def progress_line(record: StepRecord, steps: int) -> str:
    width = len(str(steps))
    line = (
        f"step {record.step:>{width}}/{steps}  loss {record.loss:.4f}  "
        f"tok/s {record.tokens_per_s:>7,.0f}  grad-norm {record.grad_norm:.3f}  "
        f"imbalance {record.imbalance:.2f}"
    )
    if record.needed_buffer_factor is not None:  # --exchange fixed
        line += f"  needed-buffer {record.needed_buffer_factor:.2f}"
        if record.reruns:
            line += (
                f" (overflowed: {record.reruns} rerun{'s' if record.reruns > 1 else ''}, "
                f"buffer_factor now {record.buffer_factor:.4g})"
            )
    return line


def load_lines(record: StepRecord) -> list[str]:
    """The router load of the last step, one compact line per MoE layer
    (:func:`dtensor_moe.moe.load_stats`, summed over all ranks)."""
    head = f"router load at step {record.step} (tokens x top-k per expert, all ranks):"
    return [head, *(f"  {layer.line()}" for layer in record.load)]


def _tail_mean(values: list[float]) -> float:
    """Mean over the second half of the run, where the router has settled."""
    tail = values[len(values) // 2 :] or values
    return sum(tail) / len(tail)


def summarize(
    runs: dict[str, list[StepRecord]],
    config: DemoConfig,
    entropy_rate: float,
    *,
    max_param_diff: float | None = None,
    dynamo: tuple[int, int] | None = None,
) -> Summary:
    """Compare the runs: ``distributed`` with ``reference``, balanced with unbalanced.

    Losses are compared over the steps whose routing agrees exactly (the same tokens per expert
    in every layer); parity holds only when that is every one of ``config.steps`` steps and the
    losses agree within :data:`PARITY_TOLERANCE` (Note [Demo parity] in this module), and, when
    ``max_param_diff`` is given (``--pp``), the params within :data:`PARAM_TOLERANCE`.
    ``dynamo``: ``(graphs, graph breaks)`` of the compiled run (``--compile``).
    """
    dist_run, ref_run = runs["distributed"], runs["reference"]
    diverged = next(
        (a.step for a, b in zip(dist_run, ref_run, strict=True) if a.expert_load != b.expert_load),
        None,
    )
    compared = len(dist_run) if diverged is None else diverged - 1
    pairs = list(zip(dist_run, ref_run, strict=True))[:compared]
    max_loss_diff = max((abs(a.loss - b.loss) for a, b in pairs), default=math.nan)
    max_norm_diff = max((abs(a.grad_norm - b.grad_norm) for a, b in pairs), default=math.nan)
    imbalance = {
        config.balance: _tail_mean([r.imbalance for r in dist_run]),
    }
    if "comparison" in runs:
        imbalance[not config.balance] = _tail_mean([r.imbalance for r in runs["comparison"]])
    fixed = {}
    if config.fixed and dist_run:
        needed = [r.needed_buffer_factor for r in dist_run]
        top = max(needed)
        fixed = dict(
            max_needed_buffer_factor=top,
            max_needed_at=dist_run[needed.index(top)].step,
            overflowed_steps=[r.step for r in dist_run if r.reruns],
            reruns=sum(r.reruns for r in dist_run),
            final_buffer_factor=dist_run[-1].buffer_factor,
            final_rows_per_pair=dist_run[-1].rows_per_pair,
        )
    compiled = {}
    if dynamo is not None and dist_run and dist_run[0].compiled_frames is not None:
        compiled = dict(
            dynamo_graphs=dynamo[0],
            dynamo_graph_breaks=dynamo[1],
            first_step_frames=dist_run[0].compiled_frames,
            recompiles={r.step: r.compiled_frames for r in dist_run[1:] if r.compiled_frames},
        )
    return Summary(
        max_loss_diff=max_loss_diff,
        max_grad_norm_diff=max_norm_diff,
        routing_diverged_at=diverged,
        compared_steps=compared,
        parity_ok=compared == config.steps
        and max_loss_diff <= PARITY_TOLERANCE
        and (max_param_diff is None or max_param_diff <= PARAM_TOLERANCE),
        imbalance_balanced=imbalance.get(True),
        imbalance_unbalanced=imbalance.get(False),
        final_loss=sum(r.loss for r in dist_run[-10:]) / len(dist_run[-10:]),
        entropy_rate=entropy_rate,
        max_param_diff=max_param_diff,
        **fixed,
        **compiled,
    )


def summary_lines(summary: Summary, config: DemoConfig) -> list[str]:
    s = summary
    loss = (
        f"loss: {s.final_loss:.4f} (mean of the last 10 steps); data entropy rate "
        f"{s.entropy_rate:.4f} (the best achievable), gap {s.final_loss - s.entropy_rate:+.4f}"
    )
    lines = [loss, _parity_line(s, config), _balance_line(s, config)]
    if s.max_needed_buffer_factor is not None:
        lines.append(_fixed_line(s, config))
    if s.dynamo_graphs is not None:
        lines.append(_compile_line(s))
    return lines


def _compile_line(s: Summary) -> str:
    """``--compile``: rank 0's dynamo counters, and the steps that compiled again."""
    later = s.recompiles or {}
    if later:
        shown = ", ".join(f"{step} ({n})" for step, n in list(later.items())[:10])
        more = ", ..." if len(later) > 10 else ""
        recompiled = f"recompiled frames at steps {shown}{more}"
    else:
        recompiled = "no recompiles after step 1"
    return (
        f"torch.compile (dynamo counters of rank 0): {s.dynamo_graphs} graphs, "
        f"{s.dynamo_graph_breaks} graph breaks; step 1 compiled {s.first_step_frames} frames, "
        f"{recompiled}"
    )


def _fixed_line(s: Summary, config: DemoConfig) -> str:
    """``--exchange fixed``: the largest factor needed, the steps that overflowed, the reruns."""
    head = (
        f"fixed exchange (--buffer-factor {config.buffer_factor:g}, --overflow "
        f"{config.overflow}): max needed buffer factor {s.max_needed_buffer_factor:.3f} (step "
        f"{s.max_needed_at}); "
    )
    steps = s.overflowed_steps
    if not steps:
        return head + (
            f"no step overflowed (0 reruns); buffer_factor {s.final_buffer_factor:.4g} "
            f"({s.final_rows_per_pair} rows per rank pair)"
        )
    shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    return head + (
        f"{len(steps)} of {config.steps} steps overflowed (step{'s' if len(steps) > 1 else ''} "
        f"{shown}), {s.reruns} rerun{'s' if s.reruns != 1 else ''}; buffer_factor "
        f"{s.final_buffer_factor:.4g} at the end ({s.final_rows_per_pair} rows per rank pair)"
    )


def _parity_line(s: Summary, config: DemoConfig) -> str:
    verdict = "OK" if s.parity_ok else "FAILED"
    head = f"parity: the same {config.steps} steps rerun in one process, same seed and weights: "
    if s.routing_diverged_at is not None:
        return head + _divergence(s, config)
    if s.max_param_diff is not None:  # --pp: the rerun accumulates the same micro-batches
        head = (
            f"parity: the same {config.steps} steps rerun in one process, same seed and "
            f"weights, accumulating the same {config.microbatches} micro-batches per step: "
        )
        return (
            head + f"every token routed identically; max |loss difference| "
            f"{s.max_loss_diff:.2e} (tolerance {PARITY_TOLERANCE:.0e}), max |param difference| "
            f"after step {config.steps} {s.max_param_diff:.2e} (tolerance "
            f"{PARAM_TOLERANCE:.0e}) -> {verdict}; max |grad-norm difference| "
            f"{s.max_grad_norm_diff:.2e}"
        )
    return (
        head + f"every token routed identically; max |loss difference| {s.max_loss_diff:.2e} "
        f"(tolerance {PARITY_TOLERANCE:.0e}) -> {verdict}; max |grad-norm difference| "
        f"{s.max_grad_norm_diff:.2e}"
    )


def _divergence(s: Summary, config: DemoConfig) -> str:
    """The parity verdict when the two runs routed some step differently: always FAILED."""
    if s.compared_steps == 0:
        losses = "nothing to compare"
    else:
        losses = (
            f"max |loss difference| over steps 1-{s.compared_steps} {s.max_loss_diff:.2e} "
            f"(tolerance {PARITY_TOLERANCE:.0e})"
        )
    return (
        f"routing differed at step {s.routing_diverged_at} (tokens per expert), so only "
        f"{s.compared_steps} of the {config.steps} steps could be compared; {losses} -> FAILED. "
        "Every step must be compared: a different expert choice is either a near-tie router "
        "score rounded differently (Note [Decisive routing] in dtensor_moe/demo/model.py) or a "
        "parallelism bug; rerun with another --seed, and if it diverges again, report it"
    )


def _balance_line(s: Summary, config: DemoConfig) -> str:
    on, off = s.imbalance_balanced, s.imbalance_unbalanced
    if on is None or off is None:
        value = on if on is not None else off
        state = "on" if on is not None else "off"
        return (
            f"load balancing {state}: imbalance (max/mean tokens per expert, second half) "
            f"{value:.2f}; rerun with --compare-balance to see the other setting"
        )
    source = "this run" if config.balance else "single-process rerun"
    other = "single-process rerun" if config.balance else "this run"
    if on < off:
        effect = f"the expert bias lowers it by {100 * (1 - on / off):.0f}%"
    else:
        effect = "the expert bias did NOT lower it on this run"
    return (
        f"load balancing: imbalance (max/mean tokens per expert, mean over the second half) "
        f"{on:.2f} with the expert bias ({source}) vs {off:.2f} without ({other}), same seed: "
        f"{effect}"
    )


def write_outputs(
    out_dir: str,
    runs: dict[str, list[StepRecord]],
    summary: Summary,
    config: DemoConfig,
    meta: dict[str, object],
) -> list[str]:
    """Write ``metrics.json`` and, when matplotlib is importable, ``training.png``.

    Returns the paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    _ignore_in_git(out_dir)
    metrics = {
        "config": {**dataclasses.asdict(config), "model": _model_dict(config)},
        **meta,
        "summary": dataclasses.asdict(summary) | {"parity_tolerance": PARITY_TOLERANCE},
        "steps": [dataclasses.asdict(r) for r in runs["distributed"]],
        "reference": _curves(runs["reference"]),
    }
    if "comparison" in runs:
        metrics["comparison"] = {"balance": not config.balance, **_curves(runs["comparison"])}
    path = os.path.join(out_dir, "metrics.json")
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    written = [path]
    png = _plot(out_dir, runs, summary, config)
    if png is not None:
        written.append(png)
    return written


def _model_dict(config: DemoConfig) -> dict[str, object]:
    model = dataclasses.asdict(config.model)
    return model


def _curves(records: list[StepRecord]) -> dict[str, list[float]]:
    return {
        "loss": [r.loss for r in records],
        "grad_norm": [r.grad_norm for r in records],
        "imbalance": [r.imbalance for r in records],
    }


def _ignore_in_git(out_dir: str) -> None:
    """Keep the output directory out of ``git status`` (as ``.pytest_cache`` does)."""
    path = os.path.join(out_dir, ".gitignore")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("# written by python -m dtensor_moe.demo\n*\n")


def _plot(
    out_dir: str, runs: dict[str, list[StepRecord]], summary: Summary, config: DemoConfig
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    _plot_loss(axes[0], runs, summary, config)
    _plot_imbalance(axes[1], runs, config)
    _plot_load(fig, axes[2], runs["distributed"], config)
    fig.tight_layout()
    path = os.path.join(out_dir, "training.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_loss(ax, runs: dict[str, list[StepRecord]], summary: Summary, config: DemoConfig) -> None:
    steps = [r.step for r in runs["distributed"]]
    ax.plot(steps, [r.loss for r in runs["distributed"]], lw=2, label=f"{config.world} processes")
    ax.plot(steps, [r.loss for r in runs["reference"]], "--", label="single process")
    ax.axhline(summary.entropy_rate, color="gray", ls=":", label="entropy rate")
    title = f"loss; max |difference| {summary.max_loss_diff:.1e}"
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.legend()


def _plot_imbalance(ax, runs: dict[str, list[StepRecord]], config: DemoConfig) -> None:
    label = {True: "expert bias on", False: "expert bias off"}
    steps = [r.step for r in runs["distributed"]]
    ax.plot(steps, [r.imbalance for r in runs["distributed"]], label=label[config.balance])
    if "comparison" in runs:
        comparison = [r.imbalance for r in runs["comparison"]]
        ax.plot(steps, comparison, label=label[not config.balance])
    ax.set(xlabel="step", ylabel="max / mean tokens per expert", title="load imbalance")
    ax.legend()


def _plot_load(fig, ax, records: list[StepRecord], config: DemoConfig):
    """Heatmap: one row per (layer, expert), one column per step; black lines between layers.

    The colors diverge from the ideal share ``1/E`` (white): red experts get more than their
    share, blue ones less. The color bar marks ``1/E`` with a black line, named in the legend.
    Returns that line.
    """
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D

    rows = [[share for layer in r.expert_load for share in layer] for r in records]
    experts, n_rows = config.model.moe.num_experts, len(rows[0])
    ideal = 1.0 / experts
    spread = max(max(abs(share - ideal) for row in rows for share in row), 1e-3 * ideal)
    image = ax.imshow(
        list(map(list, zip(*rows, strict=True))),
        aspect="auto",
        interpolation="nearest",
        extent=(0.5, len(rows) + 0.5, n_rows - 0.5, -0.5),
        cmap="RdBu_r",
        norm=Normalize(vmin=ideal - spread, vmax=ideal + spread),
    )
    for boundary in range(experts, n_rows, experts):
        ax.axhline(boundary - 0.5, color="black", lw=2)
    centers = [layer * experts + (experts - 1) / 2 for layer in range(n_rows // experts)]
    ax.set_yticks(centers, [f"layer {i}\n{experts} experts" for i in range(len(centers))])
    bias = "on" if config.balance else "off"
    ax.set(xlabel="step", title=f"share of routed tokens per expert (expert bias {bias})")
    colorbar = fig.colorbar(image, ax=ax, label="share of the routed tokens")
    label = f"ideal share 1/E = 1/{experts} = {ideal:.3g} (color bar)"
    line = colorbar.ax.axhline(ideal, color="black", lw=2, label=label)
    handle = Line2D([], [], color="black", lw=2, label=label)
    ax.legend(handles=[handle], loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    return line
