"""The demo end to end: ``python -m dtensor_moe.demo`` and the same under torchrun.

CI runs one small setting under ``torchrun --standalone --nproc-per-node 4`` (sequence length
13, not divisible by tp=2; ``--optimizer muon``), the plain launcher once with another layout,
once with pipeline parallelism (``--pp 2``, 8 processes), and the flag checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys

import pytest

from dtensor_moe.demo.config import LayoutError, build_parser, resolve_config
from dtensor_moe.demo.report import (
    PARAM_TOLERANCE,
    PARITY_TOLERANCE,
    load_lines,
    progress_line,
    summarize,
    summary_lines,
)
from dtensor_moe.moe import LayerLoad
from dtensor_moe.demo.train import StepRecord

SMALL = ["--steps", "6", "--batch", "4", "--seq-len", "13", "--layers", "1", "--dim", "32"]
METRICS_KEYS = {"config", "layout", "entropy_rate", "summary", "steps", "reference", "wall_time_s"}
STEP_KEYS = {"step", "loss", "grad_norm", "tokens_per_s", "imbalance", "expert_load"}


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env
    )


def _check_metrics(out_dir: str, steps: int) -> dict:
    with open(os.path.join(out_dir, "metrics.json")) as f:
        metrics = json.load(f)
    assert METRICS_KEYS <= metrics.keys()
    assert len(metrics["steps"]) == steps and STEP_KEYS <= metrics["steps"][0].keys()
    summary = metrics["summary"]
    assert summary["routing_diverged_at"] is None and summary["compared_steps"] == steps, summary
    assert summary["parity_ok"] and summary["max_loss_diff"] <= PARITY_TOLERANCE, summary
    assert summary["max_grad_norm_diff"] <= 1e-4, summary  # clip_grad_norm_ across meshes
    return metrics


@pytest.fixture(scope="module")
def torchrun_metrics(tmp_path_factory) -> dict:
    """One end-to-end run under ``torchrun --standalone --nproc-per-node 4`` (default layout),
    with ``--optimizer muon``: Muon assembles the TP- and FSDP-split matrices on owner ranks,
    and the parity proof against the one-process rerun (the same optimizers on plain tensors)
    must pass. The default optimizer (fused AdamW) on the default layout runs in CI in
    tests/test_docs_snippets.py::test_quoted_demo_output_is_printed (the default demo)."""
    out = str(tmp_path_factory.mktemp("demo") / "out")
    torchrun = "-m torch.distributed.run --standalone --nproc-per-node 4 -m dtensor_moe.demo"
    cmd = [sys.executable, *torchrun.split(), "--optimizer", "muon", *SMALL, "--out", out]
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> OK" in proc.stdout and "load balancing:" in proc.stdout, proc.stdout
    assert "dtensor_moe.optim.Muon (match_rms_adamw, float32" in proc.stdout, proc.stdout
    # dtensor_moe.moe.load_stats at the end, rank 0 only: one line per MoE layer (--layers 1)
    assert proc.stdout.count("router load at step 6") == 1, proc.stdout
    assert proc.stdout.count("layers.0.moe: tokens/expert min") == 1, proc.stdout
    assert "dropped 0" in proc.stdout, proc.stdout
    return _check_metrics(out, steps=6)


def test_torchrun_four_processes(torchrun_metrics):
    config = torchrun_metrics["config"]
    layout = (config["world"], config["dp"], config["tp"], config["ep"], config["expert_tp"])
    assert layout == (4, 2, 2, 2, False) and config["sequence_parallel"]
    assert len(torchrun_metrics["layout"]) >= 2  # params on several meshes
    assert len(torchrun_metrics["comparison"]["loss"]) == 6
    assert config["optimizer"] == "muon"


def test_plain_launch_other_layout(tmp_path):
    out = str(tmp_path / "out")
    flags = "--nproc 2 --tp 2 --ep 1 --no-sp --no-balance --no-compare-balance".split()
    cmd = [sys.executable, "-m", "dtensor_moe.demo", *flags, *SMALL, "--out", out]
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = _check_metrics(out, steps=6)
    assert metrics["config"]["expert_tp"] and not metrics["config"]["sequence_parallel"]
    assert "comparison" not in metrics


# --compile of the demo (about 20 s): DTENSOR_MOE_FULL_MATRIX=1; compiled blocks against eager
# are covered in CI by tests/test_parallel_compile.py and tests/test_moe_compile.py
if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1":

    def test_compiled_blocks_keep_parity(tmp_path):
        # --compile compiles every block of the distributed model (SP2 + EP2 here, uneven L=13);
        # the parity proof against the eager single-process rerun must still pass. aot_eager keeps
        # the test short; `python -m dtensor_moe.demo --compile` (inductor) is in docs/benchmarks.md.
        out = str(tmp_path / "out")
        flags = "--compile --compile-backend aot_eager --no-compare-balance".split()
        cmd = [sys.executable, "-m", "dtensor_moe.demo", *flags, *SMALL, "--out", out]
        proc = _run(cmd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "compiled blocks" in proc.stdout and "-> OK" in proc.stdout, proc.stdout
        metrics = _check_metrics(out, steps=6)
        assert metrics["config"]["compile"] and metrics["config"]["compile_backend"] == "aot_eager"


def test_invalid_layout_stops_before_starting(tmp_path):
    proc = _run(
        [sys.executable, "-m", "dtensor_moe.demo", "--tp", "3", "--out", str(tmp_path)], timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        (
            "python -m dtensor_moe.demo: error: --tp 3 does not divide the 4 processes; "
            "choose --tp in {1, 2, 4} and --dp = 4 // tp"
        )
    ]
    assert proc.stdout == "" and not os.path.exists(tmp_path / "metrics.json")


def _resolve(flags: list[str], world: int = 4):
    return resolve_config(build_parser().parse_args(flags), world)


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--dp", "4", "--tp", "2"], 4, r"--dp 4 x --tp 2 = 8, but there are 4 processes"),
        (["--tp", "3"], 4, r"--tp 3 does not divide the 4 processes"),
        (["--heads", "6", "--dim", "48", "--tp", "4"], 4, r"--heads 6 is not divisible by --tp 4"),
        (["--experts", "6", "--ep", "4"], 4, r"--experts 6 is not divisible by --ep 4"),
        (["--ep", "8"], 4, r"--ep 8 with --tp 2: EP borrows the tp ranks, .* --ep in \{1, 2, 4\}$"),
        (["--ep", "4", "--expert-tp"], 4, r"--ep 4 does not divide --dp 2; with --expert-tp"),
        (["--tp", "1", "--ep", "8"], 4, r"--ep 8 does not divide --dp 4; with --tp 1"),
        (["--ep", "1", "--hidden", "63"], 4, r"--hidden 63 is not divisible by --tp 2"),
        (
            ["--experts", "3", "--hidden", "63", "--expert-tp"],
            4,
            r"no --ep works with the other flags as given; change --experts, --hidden or --dim$",
        ),
        (["--batch", "3"], 4, r"--batch 3 is not divisible by --dp 2"),
        (["--vocab", "63"], 4, r"--vocab 63 is not divisible by --tp 2"),
        (["--dim", "36", "--heads", "4"], 4, r"--dim 36 must be an even multiple of --heads 4"),
        (["--top-k", "9"], 4, r"--top-k 9 exceeds --experts 8"),
        (["--steps", "0"], 4, r"--steps must be >= 1, got 0"),
    ],
)
def test_invalid_flags_messages(flags, world, message):
    with pytest.raises(LayoutError, match=message):
        _resolve(flags, world)


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--pp", "3"], 8, r"^--pp 3 does not divide the 8 processes; .*--pp in \{1, 2, 4, 8\}"),
        (["--pp", "0"], 8, r"^--pp must be >= 1, got 0$"),
        (
            ["--pp", "2", "--dp", "4"],
            8,
            r"^--dp 4 x --tp 2 = 8, but there are 4 processes of each of the 2 stages; "
            r"pp \* dp \* tp must equal",
        ),
        (
            ["--pp", "2", "--schedule", "interleaved"],
            8,
            r"^--layers 2 cannot be split evenly over the 4 stages of --pp 2 --schedule "
            r"interleaved \(2 per pp rank\); choose --layers a multiple of 4$",
        ),
        (["--pp", "2", "--layers", "3"], 8, r"^--layers 3 cannot be split evenly over the 2 "),
        (
            ["--pp", "2", "--microbatches", "1"],
            8,
            r"^--microbatches 1 is fewer than the 2 stages; Schedule1F1B needs",
        ),
        (
            ["--pp", "2", "--schedule", "interleaved", "--layers", "4", "--microbatches", "3"],
            8,
            r"^--microbatches 3 is not a multiple of --pp 2",
        ),
        (
            ["--pp", "2", "--microbatches", "3"],
            8,
            r"^--batch 8 is not divisible by dp \* microbatches = 2 \* 3",
        ),
        (["--pp", "2", "--microbatches", "0"], 8, r"^--microbatches must be >= 1, got 0$"),
        (["--pp", "2", "--compile"], 8, r"^--compile cannot be combined with --pp"),
        (["--schedule", "gpipe"], 4, r"^--schedule gpipe needs --pp 2 or more"),
        (["--microbatches", "2"], 4, r"^--microbatches 2 needs --pp 2 or more"),
    ],
)
def test_invalid_pipeline_flags_messages(flags, world, message):
    with pytest.raises(LayoutError, match=message):
        _resolve(flags, world)


def test_pipeline_defaults_and_world():
    # --pp 2 on 8 processes: every stage has the default 4-rank layout
    config = _resolve(["--pp", "2"], 8)
    assert (config.world, config.pp, config.dp, config.tp, config.ep) == (8, 2, 2, 2, 2)
    assert (config.schedule, config.microbatches, config.num_stages) == ("1f1b", 4, 2)
    assert config.microbatch_size == 1 and config.layout_line().startswith(
        "world=8  pp=2 (1f1b, 2 stages, 4 micro-batches)  dense: dp=2  tp=2"
    )
    interleaved = _resolve(["--pp", "2", "--schedule", "interleaved", "--layers", "4"], 8)
    assert (interleaved.num_stages, interleaved.microbatches) == (4, 4)
    assert _resolve(["--pp", "2", "--schedule", "gpipe", "--microbatches", "1"], 8).pp == 2
    plain = _resolve([])  # without --pp nothing changes
    assert (plain.pp, plain.microbatches) == (1, 1)
    assert plain.layout_line() == "world=4  dense: dp=2  tp=2  sp=on  experts: ep=2  etp=1  edp=2"


def test_pipeline_process_count_of_plain_launch():
    from dtensor_moe.demo.launch import _plain_world

    assert _plain_world(None, None, None, 2) == 8  # pp * the default 4
    assert _plain_world(None, 1, 2, 2) == 4
    assert _plain_world(6, None, None, 2) == 6
    assert _plain_world(None, None, None) == 4


def test_pipeline_flag_stops_before_starting(tmp_path, monkeypatch, capsys):
    # main() as `python -m dtensor_moe.demo` runs it (sys.exit(main())), in this process: the
    # interpreter's exit status and stderr are checked by test_invalid_layout_stops_before_starting
    from dtensor_moe.demo.launch import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    flags = ["--pp", "2", "--schedule", "interleaved", "--out", str(tmp_path)]
    assert main(flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert captured.err.strip().splitlines() == [
        "python -m dtensor_moe.demo: error: --layers 2 cannot be split evenly over the 4 stages "
        "of --pp 2 --schedule interleaved (2 per pp rank); choose --layers a multiple of 4"
    ]
    assert not os.path.exists(tmp_path / "metrics.json")


# --optimizer muon under the plain launcher (about 10 s): DTENSOR_MOE_FULL_MATRIX=1; in CI the
# torchrun run (torchrun_metrics, test_torchrun_four_processes) trains the same default layout
# with --optimizer muon and checks the same lines and parity
if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1":

    def test_muon_keeps_parity(tmp_path):
        # --optimizer muon on the default layout (dp2 x tp2 with SP, EP2, FSDP2): Muon assembles
        # the TP- and FSDP-split matrices on owner ranks; the parity proof against the
        # one-process rerun (the same optimizers on plain tensors) must pass.
        out = str(tmp_path / "out")
        flags = ["--optimizer", "muon", "--no-compare-balance", *SMALL, "--out", out]
        proc = _run([sys.executable, "-m", "dtensor_moe.demo", *flags])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "dtensor_moe.optim.Muon (match_rms_adamw, float32" in proc.stdout, proc.stdout
        assert "-> OK" in proc.stdout, proc.stdout
        metrics = _check_metrics(out, steps=6)
        assert metrics["config"]["optimizer"] == "muon"


def test_pipeline_1f1b_eight_processes(tmp_path):
    # --pp 2 --schedule 1f1b on 8 processes: two stages, each dp2 x tp2 with SP and EP2 (the
    # default layout), FSDP2 in each stage; 4 micro-batches of one sequence per pipeline. The
    # parity proof also compares every param after the last step with the rerun that
    # accumulates the same micro-batches.
    out = str(tmp_path / "out")
    flags = "--pp 2 --schedule 1f1b --steps 3 --seq-len 13 --dim 32 --no-compare-balance"
    cmd = [sys.executable, "-m", "dtensor_moe.demo", *flags.split(), "--out", out]
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on 8 gloo processes" in proc.stdout, proc.stdout
    assert "Schedule1F1B, 4 micro-batches of 1 sequence(s) per pipeline" in proc.stdout
    assert "accumulating the same 4 micro-batches per step" in proc.stdout, proc.stdout
    assert "max |param difference| after step 3" in proc.stdout and "-> OK" in proc.stdout
    # load_stats with meshes=: every layer of both stages, on rank 0 (a stage-0 rank)
    assert "layers.0.moe: tokens/expert" in proc.stdout, proc.stdout
    assert "layers.1.moe: tokens/expert" in proc.stdout, proc.stdout
    metrics = _check_metrics(out, steps=3)
    config, summary = metrics["config"], metrics["summary"]
    layout = (config["world"], config["pp"], config["dp"], config["tp"], config["ep"])
    assert layout == (8, 2, 2, 2, 2)
    assert (config["schedule"], config["microbatches"]) == ("1f1b", 4)
    assert summary["max_param_diff"] <= PARAM_TOLERANCE, summary


def test_ep_suggestion_for_six_experts():
    # 6 experts on dp2 x tp2: ep 3 and 6 divide the experts but not the mesh, so only 1 and 2
    with pytest.raises(LayoutError) as err:
        _resolve(["--experts", "6", "--ep", "4"])
    assert str(err.value) == (
        "--experts 6 is not divisible by --ep 4; each ep rank holds experts / ep experts; "
        "choose --ep in {1, 2}"
    )
    for ep in ("1", "2"):
        assert _resolve(["--experts", "6", "--ep", ep]).ep == int(ep)


def _ep_fixes(message: str) -> tuple[list[int], list[str]]:
    """The ``--ep`` values and the ``--expert-tp`` flags a rejection message suggests."""
    listed = re.search(r"choose --ep in \{([\d, ]+)\}", message)
    eps = [int(e) for e in listed.group(1).split(", ")] if listed else []
    return eps, re.findall(r"add (--(?:no-)?expert-tp) with --ep (\d+)", message)


@pytest.mark.parametrize("world_tp", [(4, 1), (4, 2), (4, 4), (8, 2)])
def test_suggested_ep_values_are_exactly_the_working_ones(world_tp):
    # Every --ep a rejection suggests resolves, and every other --ep up to the world fails;
    # over expert counts, --expert-tp settings and widths that hit each rule.
    world, tp = world_tp
    rejected = 0
    for experts, ep, expert_tp, hidden in itertools.product(
        (1, 2, 3, 4, 6, 8, 12), range(1, world + 3), (None, "--expert-tp", "--no-expert-tp"),
        (64, 63, 36),
    ):
        base = ["--tp", str(tp), "--experts", str(experts), "--top-k", "1", "--hidden", str(hidden)]
        base += [expert_tp] if expert_tp else []
        try:
            _resolve([*base, "--ep", str(ep)], world)
            continue
        except LayoutError as err:
            message = str(err)
        rejected += 1
        eps, toggles = _ep_fixes(message)
        assert eps or toggles or "no --ep works" in message, message
        for other in range(1, world + 1):
            if other in eps:
                assert _resolve([*base, "--ep", str(other)], world).ep == other, message
            else:
                with pytest.raises(LayoutError):
                    _resolve([*base, "--ep", str(other)], world)
        for flag, value in toggles:
            plain = [f for f in base if f not in ("--expert-tp", "--no-expert-tp")]
            assert _resolve([*plain, flag, "--ep", value], world).ep == int(value), message
    assert rejected > 50


def test_defaults():
    config = _resolve([])
    assert (config.world, config.dp, config.tp, config.ep) == (4, 2, 2, 2)
    assert config.sequence_parallel and not config.expert_tp
    assert _resolve(["--ep", "1"]).expert_tp  # experts then split over tp by expert TP
    assert config.balance and config.model.moe.use_expert_bias
    assert config.optimizer == "adamw" and _resolve(["--optimizer", "muon"]).optimizer == "muon"
    assert isinstance(build_parser().parse_args([]), argparse.Namespace)


def _records(losses: list[float], loads: list[float]) -> list[StepRecord]:
    """One record per step; ``loads[i]`` is expert 0's share of step i's tokens (2 experts)."""
    return [
        StepRecord(
            step=i + 1,
            loss=loss,
            grad_norm=0.5,
            tokens_per_s=1.0,
            imbalance=1.0,
            expert_load=[[load, 1.0 - load]],
        )
        for i, (loss, load) in enumerate(zip(losses, loads, strict=True))
    ]


def test_load_lines():
    layer = LayerLoad.from_counts("layers.0.moe", [6, 0, 2, 4])
    record = dataclasses.replace(_records([1.0], [0.5])[0], load=(layer,))
    assert load_lines(record) == [
        "router load at step 1 (tokens x top-k per expert, all ranks):",
        "  layers.0.moe: tokens/expert min 0 max 6 mean 3.0 cv 0.75; dead experts 1/4; "
        "dropped 0",
    ]


def _parity(ref_losses: list[float], ref_loads: list[float]):
    """Summary and parity line of a 4-step run against a rerun with the given curves."""
    config = _resolve(["--steps", "4", "--no-compare-balance"])
    runs = {
        "distributed": _records([4.0, 3.0, 2.0, 1.5], [0.5, 0.5, 0.25, 0.75]),
        "reference": _records(ref_losses, ref_loads),
    }
    summary = summarize(runs, config, entropy_rate=1.4)
    return summary, summary_lines(summary, config)[1]


def test_parity_tolerance_is_tight():
    # fp32 reruns differ by about 1e-6; a 2e-5 difference is a real discrepancy.
    loads = [0.5, 0.5, 0.25, 0.75]
    ok, line = _parity([4.0, 3.0 + 1e-6, 2.0, 1.5], loads)
    assert ok.parity_ok and ok.compared_steps == 4 and "-> OK" in line, line
    bad, line = _parity([4.0, 3.0, 2.0 + 2e-5, 1.5], loads)
    assert not bad.parity_ok and bad.max_loss_diff == pytest.approx(2e-5), bad
    assert "every token routed identically" in line and "(tolerance 1e-05) -> FAILED" in line


def test_pipeline_parity_needs_the_params():
    # --pp: equal losses and routing, but a param off by more than PARAM_TOLERANCE fails
    config = _resolve(["--pp", "2", "--steps", "4", "--no-compare-balance"], 8)
    loads = [0.5, 0.5, 0.25, 0.75]
    runs = {"distributed": _records([4.0, 3.0, 2.0, 1.5], loads)}
    runs["reference"] = _records([4.0, 3.0, 2.0, 1.5], loads)
    for diff, ok in ((PARAM_TOLERANCE / 2, True), (3e-3, False)):
        summary = summarize(runs, config, entropy_rate=1.4, max_param_diff=diff)
        line = summary_lines(summary, config)[1]
        assert summary.parity_ok is ok and summary.max_param_diff == diff, summary
        assert "accumulating the same 4 micro-batches per step" in line, line
        assert f"max |param difference| after step 4 {diff:.2e}" in line, line
        assert line.count("-> OK" if ok else "-> FAILED") == 1, line


def test_parity_fails_when_routing_diverges():
    # Equal losses, but step 3 sent tokens to other experts: only 2 of 4 steps are comparable.
    summary, line = _parity([4.0, 3.0, 2.0, 1.5], [0.5, 0.5, 0.5, 0.75])
    assert (summary.routing_diverged_at, summary.compared_steps) == (3, 2), summary
    assert not summary.parity_ok and summary.max_loss_diff == 0.0, summary
    assert "routing differed at step 3" in line and "only 2 of the 4 steps" in line, line
    assert line.count("-> FAILED") == 1 and "--seed" in line, line
    first, line = _parity([4.0, 3.0, 2.0, 1.5], [0.25, 0.5, 0.25, 0.75])
    assert first.compared_steps == 0 and not first.parity_ok, first
    assert "only 0 of the 4 steps" in line and "nothing to compare -> FAILED" in line, line


def test_load_chart_marks_the_ideal_share():
    # The per-expert chart draws 1/E on its color bar and names it in the legend; the colors
    # are centred on it (white = the ideal share).
    import matplotlib  # in the test extra: no skip

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dtensor_moe.demo.report import _plot_load

    config = _resolve(["--experts", "2", "--top-k", "1", "--steps", "4"])
    fig, ax = plt.subplots()
    try:
        line = _plot_load(fig, ax, _records([4.0, 3.0, 2.0, 1.5], [0.5, 0.7, 0.2, 0.6]), config)
        assert list(line.get_ydata()) == [0.5, 0.5]
        labels = [text.get_text() for text in ax.get_legend().get_texts()]
        assert labels == ["ideal share 1/E = 1/2 = 0.5 (color bar)"] == [line.get_label()]
        norm = ax.images[0].norm
        assert (norm.vmin, norm.vmax) == pytest.approx((0.2, 0.8))  # 0.5 -/+ the largest gap
    finally:
        plt.close(fig)


# --- --exchange fixed (dtensor_moe/routed/fixed.py): flags, metrics, parity, --compile -------

# SMALL with an even --seq-len (the strict run's overflow at step 4 is this routing's); SMALL's
# --seq-len 13 runs in test_fixed_exchange_keeps_parity: under sequence parallelism tp=2
# splits every sequence 7 + 6, so the ranks route different numbers of tokens and the buffers
# hold the larger (Note [The agreed size] in dtensor_moe/routed/fixed.py)
FIXED_SMALL = [*SMALL[:4], "--seq-len", "12", *SMALL[6:]]
FIXED_STEP_KEYS = {"needed_buffer_factor", "reruns", "max_rows_per_pair", "buffer_factor",
                   "rows_per_pair"}  # fmt: skip


def _rows_per_pair(factor: float, n: int, p: int) -> int:
    """The fixed exchange's buffer rule (Note [Fixed-buffer exchange]), written out here."""
    return max(8, -(-math.ceil(factor * n / p) // 8) * 8)


def _check_fixed_steps(metrics: dict, factor: float) -> list[dict]:
    """Each step of a ``--exchange fixed --overflow rerun`` run: it reran exactly when its
    fullest rank pair did not fit the buffer the step started with, and the buffer it ended
    with holds it; the needed factor is that pair's rows over the balanced share."""
    steps = metrics["steps"]
    n = metrics["fixed_exchange"]["routed_pairs_per_rank"]
    p = metrics["fixed_exchange"]["ep_ranks"]
    before = _rows_per_pair(factor, n, p)
    for s in steps:
        assert FIXED_STEP_KEYS <= s.keys(), s.keys()
        assert (s["reruns"] > 0) == (s["max_rows_per_pair"] > before), (s, before)
        assert s["max_rows_per_pair"] <= s["rows_per_pair"], s
        assert s["rows_per_pair"] == _rows_per_pair(s["buffer_factor"], n, p), s
        assert s["needed_buffer_factor"] == pytest.approx(s["max_rows_per_pair"] * p / n), s
        before = s["rows_per_pair"]
    summary = metrics["summary"]
    assert summary["overflowed_steps"] == [s["step"] for s in steps if s["reruns"]], summary
    assert summary["reruns"] == sum(s["reruns"] for s in steps), summary
    assert summary["max_needed_buffer_factor"] == max(s["needed_buffer_factor"] for s in steps)
    return steps


def test_fixed_exchange_keeps_parity(tmp_path):
    # the default layout (dp2 x tp2 with SP, EP2 borrowing the tp ranks) on the fixed
    # exchange at buffer_factor 1.0, with --seq-len 13 split 7 + 6 over tp (the ranks route
    # 28 and 24 pairs; the buffers hold 28), where routing overflows the buffer:
    # step_without_overflow runs such a step again with a 1.5x factor before the optimizer
    # step, so the training and the parity proof are those of the all-to-all exchange
    out = str(tmp_path / "out")
    flags = ["--exchange", "fixed", "--buffer-factor", "1", "--no-compare-balance", *SMALL,
             "--out", out]  # fmt: skip
    proc = _run([sys.executable, "-m", "dtensor_moe.demo", *flags])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exchange=fixed (buffer_factor 1, overflow rerun)" in proc.stdout, proc.stdout
    assert "-> OK" in proc.stdout and "dropped 0" in proc.stdout, proc.stdout
    metrics = _check_metrics(out, steps=6)
    config = metrics["config"]
    assert (config["exchange"], config["buffer_factor"], config["overflow"]) == (
        "fixed", 1.0, "rerun")  # fmt: skip
    # N: 2 sequences per dp rank x 7 tokens (the longer shard of 13 over tp 2) x top-2; P: the
    # 2 ep ranks
    assert metrics["fixed_exchange"] == {"routed_pairs_per_rank": 28, "ep_ranks": 2}
    steps = _check_fixed_steps(metrics, factor=1.0)
    overflowed = [s["step"] for s in steps if s["reruns"]]
    assert overflowed, steps  # the rerun path ran
    summary = metrics["summary"]
    line = re.search(r"^fixed exchange \(--buffer-factor 1, --overflow rerun\): max needed "
                     r"buffer factor (\d\.\d{3}) \(step (\d+)\); (\d+) of 6 steps overflowed "
                     r"\(steps? ([\d, ]+)\), (\d+) reruns?; buffer_factor ([\d.]+) at the end "
                     r"\((\d+) rows per rank pair\)$", proc.stdout, re.M)  # fmt: skip
    assert line, proc.stdout
    assert float(line[1]) == pytest.approx(summary["max_needed_buffer_factor"], abs=5e-4)
    assert int(line[3]) == len(overflowed) and line[4] == ", ".join(map(str, overflowed))
    assert int(line[5]) == summary["reruns"] and int(line[7]) == steps[-1]["rows_per_pair"]
    for s in overflowed:  # the progress line of an overflowed step says so
        assert re.search(rf"^step {s}/6 .* needed-buffer [\d.]+ \(overflowed: \d+ reruns?, "
                         r"buffer_factor now [\d.]+\)$", proc.stdout, re.M), proc.stdout
    # the reference rerun has no exchange: nothing of the fixed exchange in its records
    assert metrics["reference"].keys() == {"loss", "grad_norm", "imbalance"}


def test_fixed_exchange_strict_stops_at_the_overflow(tmp_path):
    # --overflow strict: the same run stops at step 4 (see above) on every rank, before that
    # step's optimizer step, with the layer, the rank pair and the flags to change; exit 1
    out = str(tmp_path / "out")
    flags = ["--exchange", "fixed", "--overflow", "strict", "--no-compare-balance",
             *FIXED_SMALL, "--out", out]  # fmt: skip
    proc = _run([sys.executable, "-m", "dtensor_moe.demo", *flags])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 3/6" in proc.stdout and "step 4/6" not in proc.stdout, proc.stdout
    stop = re.search(
        r"^python -m dtensor_moe.demo: step 4 overflowed under --overflow strict: the fixed "
        r"exchange of 'layers.0.moe.experts' over DeviceMesh\(.*\) had (\d+) rows? that did not "
        r"fit its buffer of 16 rows towards rank \d \(buffer_factor=1.25\).* In the demo: this "
        r"step needed --buffer-factor (\d\.\d\d) or more \(given: 1.25\); rerun with it, or with "
        r"--overflow rerun; exit code 1$",
        proc.stderr, re.M,
    )  # fmt: skip
    assert stop, proc.stderr
    # the factor the demo names holds the step's fullest pair: 16 rows + those that did not fit
    # (N = 24 rows per rank, P = 2 ranks)
    assert _rows_per_pair(float(stop[2]), 24, 2) >= 16 + int(stop[1]), stop[0]
    assert "Traceback" not in proc.stderr and not os.path.exists(os.path.join(out, "metrics.json"))


# --compile with the fixed exchange. CI: the "eager" backend (about 30 s on a busy 2-core
# machine): dynamo traces the blocks as with any backend, and dynamo is where a grown factor
# failed (Note [The factor as text] in dtensor_moe/routed/fixed.py). DTENSOR_MOE_FULL_MATRIX=1
# adds inductor, the demo's default (1.5 to 3 minutes there).
@pytest.mark.parametrize(
    "backend", ["eager"] + (["inductor"] if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
                            else [])  # fmt: skip
)
def test_fixed_exchange_compiled_keeps_parity(tmp_path, backend):
    # EP over all 4 ranks (--tp 1 --ep 4): step 1 overflows the default buffer, so its rerun
    # compiles the blocks once more for the grown factor (Note [The factor as text] in
    # routed/fixed.py); the routed experts compile with the rest of each block (no eager
    # island). After step 2 (the one-time checks' flags change the guards) nothing recompiles.
    out = str(tmp_path / "out")
    flags = ["--tp", "1", "--ep", "4", "--exchange", "fixed", "--compile", "--compile-backend",
             backend, "--no-compare-balance", *FIXED_SMALL, "--steps", "3",
             "--out", out]  # fmt: skip
    proc = _run([sys.executable, "-m", "dtensor_moe.demo", *flags], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled blocks" in proc.stdout and "-> OK" in proc.stdout, proc.stdout
    metrics = _check_metrics(out, steps=3)
    steps = _check_fixed_steps(metrics, factor=1.25)
    assert steps[0]["reruns"] >= 1, steps  # the compiled blocks met a grown factor
    frames = [s["compiled_frames"] for s in steps]
    assert frames[0] > 0 and frames[2] == 0, frames  # no recompile every step
    assert re.search(r"^torch.compile \(dynamo counters of rank 0\): \d+ graphs, \d+ graph "
                     r"breaks; step 1 compiled \d+ frames, ", proc.stdout, re.M), proc.stdout
    assert metrics["config"]["compile_backend"] == backend


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--buffer-factor", "2"],
            "--buffer-factor 2.0 needs --exchange fixed (only the fixed exchange has buffers), "
            "got --exchange all_to_all; add --exchange fixed or drop --buffer-factor",
        ),
    ],
)
def test_fixed_exchange_flag_errors_exit_2(flags, message, tmp_path, monkeypatch, capsys):
    # main() as `python -m dtensor_moe.demo` runs it (sys.exit(main())): exit status 2 and one
    # line on stderr, before any process starts
    from dtensor_moe.demo.launch import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main([*flags, "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"python -m dtensor_moe.demo: error: {message}"]
    assert captured.out == "" and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--overflow", "strict"], 4, r"^--overflow strict needs --exchange fixed .*drop "
         r"--overflow$"),
        (["--exchange", "all_gather", "--buffer-factor", "2"], 4, r"^--buffer-factor 2.0 needs "
         r"--exchange fixed .*, got --exchange all_gather"),
        (["--exchange", "fixed", "--tp", "1"], 4, r"^--exchange fixed needs expert parallelism "
         r"\(--ep 2 or more\), but ep is 1 here \(--ep defaults to --tp, which is 1\); choose "
         r"--ep in \{2, 4\}, or drop --exchange fixed$"),
        (["--exchange", "fixed", "--ep", "1"], 4, r"^--exchange fixed needs expert parallelism "
         r"\(--ep 2 or more\), but got --ep 1; choose --ep in \{2, 4\}"),
        (["--exchange", "all_gather", "--tp", "1", "--ep", "1"], 4, r"^--exchange all_gather "
         r"needs expert parallelism"),
        (["--exchange", "fixed", "--experts", "6", "--tp", "4"], 4, r"but ep is 1 here \(--ep "
         r"defaults to 1 when --tp 4 does not divide --experts 6\); no --ep of 2 or more works "
         r"with the other flags as given: drop --exchange fixed$"),
        (["--exchange", "fixed", "--buffer-factor", "0.9"], 4, r"^--buffer-factor must be a "
         r"finite number >= 1.0 .*got 0.9"),
        (["--exchange", "fixed", "--buffer-factor", "inf"], 4, r"^--buffer-factor must be a "
         r"finite number >= 1.0 .*got inf"),
        (["--exchange", "fixed", "--dim", "34", "--heads", "1", "--tp", "1", "--ep", "2"], 4,
         r"computes the experts with torch._grouped_mm, which needs float32 rows of a multiple "
         r"of 16 bytes: --dim 34 and --hidden 68 must be multiples of 4; choose them so, or "
         r"--exchange all_to_all$"),
        (["--exchange", "fixed", "--tp", "1", "--ep", "2", "--hidden", "66"], 4,
         r"--dim 64 and --hidden 66 must be multiples of 4"),
        (["--exchange", "fixed", "--expert-tp", "--ep", "2", "--hidden", "36"], 4,
         r"--hidden 36 \(--hidden / --tp 2 under expert TP: 18\) must be multiples of 4"),
    ],
)
def test_fixed_exchange_invalid_flags_messages(flags, world, message):
    with pytest.raises(LayoutError, match=message):
        _resolve(flags, world)


def test_fixed_exchange_accepted_layouts_and_sizes():
    # N (rows per rank per forward: tokens x top-k, x tp under expert TP) and P (the exchange's
    # ranks), which the demo checks against the exchanges at step 1 and the metrics record
    cases = [
        ([], 4, 1.25, "rerun", 4 * 32 * 2, 2),  # default: 4 sequences per dp rank, 64 / tp 2
        (["--tp", "1", "--ep", "4"], 4, 1.25, "rerun", 2 * 64 * 2, 4),
        (["--ep", "2", "--expert-tp"], 4, 1.25, "rerun", 4 * 32 * 2 * 2, 4),
        (["--tp", "4", "--seq-len", "1", "--batch", "4"], 4, 1.25, "rerun", 4 * 1 * 2 // 4, 4),
        (["--no-sp", "--seq-len", "13"], 4, 1.25, "rerun", 4 * 13 // 2 * 2, 2),  # 52 tokens
        (["--pp", "2"], 8, 1.25, "rerun", 1 * 32 * 2, 2),  # one micro-batch of one sequence
        (["--buffer-factor", "2", "--overflow", "strict"], 4, 2.0, "strict", 4 * 32 * 2, 2),
    ]
    for flags, world, factor, overflow, n, p in cases:
        config = _resolve(["--exchange", "fixed", *flags], world)
        got = (config.buffer_factor, config.overflow, config.routed_pairs, config.ep_ranks)
        assert got == (factor, overflow, n, p), (flags, got)
    assert _resolve(["--exchange", "fixed"]).layout_line() == (
        "world=4  dense: dp=2  tp=2  sp=on  experts: ep=2  etp=1  edp=2  exchange=fixed "
        "(buffer_factor 1.25, overflow rerun)"
    )
    gather = _resolve(["--exchange", "all_gather"])
    assert (gather.buffer_factor, gather.overflow) == (None, None)
    assert gather.layout_line().endswith("edp=2  exchange=all_gather")
    plain = _resolve([])
    assert (plain.exchange, plain.buffer_factor, plain.overflow, plain.fixed) == (
        "all_to_all", None, None, False)  # fmt: skip


def test_fixed_exchange_summary_and_progress_lines():
    config = _resolve(["--exchange", "fixed", "--steps", "4", "--no-compare-balance"])
    loads = [0.5, 0.5, 0.25, 0.75]
    fixed = [  # (needed, reruns, factor at the end, C at the end)
        (1.1, 0, 1.25, 160), (1.4, 1, 1.875, 240), (1.6, 0, 1.875, 240), (1.9, 1, 2.8125, 360),
    ]  # fmt: skip
    dist_run = [
        dataclasses.replace(r, needed_buffer_factor=n, reruns=k, buffer_factor=f,
                            rows_per_pair=c, max_rows_per_pair=round(n * 128))
        for r, (n, k, f, c) in zip(_records([4.0, 3.0, 2.0, 1.5], loads), fixed, strict=True)
    ]  # fmt: skip
    runs = {"distributed": dist_run, "reference": _records([4.0, 3.0, 2.0, 1.5], loads)}
    summary = summarize(runs, config, entropy_rate=1.4)
    assert (summary.max_needed_buffer_factor, summary.max_needed_at) == (1.9, 4)
    assert (summary.overflowed_steps, summary.reruns) == ([2, 4], 2)
    assert summary_lines(summary, config)[-1] == (
        "fixed exchange (--buffer-factor 1.25, --overflow rerun): max needed buffer factor 1.900 "
        "(step 4); 2 of 4 steps overflowed (steps 2, 4), 2 reruns; buffer_factor 2.812 at the "
        "end (360 rows per rank pair)"
    )
    assert progress_line(dist_run[1], 4).endswith(
        "needed-buffer 1.40 (overflowed: 1 rerun, buffer_factor now 1.875)"
    )
    assert progress_line(dist_run[0], 4).endswith("imbalance 1.00  needed-buffer 1.10")
    calm = [dataclasses.replace(r, reruns=0) for r in dist_run[:1]] * 4
    calm = [dataclasses.replace(r, step=i + 1) for i, r in enumerate(calm)]
    quiet = summarize({"distributed": calm, "reference": runs["reference"]}, config, 1.4)
    assert summary_lines(quiet, config)[-1].endswith(
        "max needed buffer factor 1.100 (step 1); no step overflowed (0 reruns); buffer_factor "
        "1.25 (160 rows per rank pair)"
    )
    # without --exchange fixed no such line, and the progress line is as before
    plain = _resolve(["--steps", "4", "--no-compare-balance"])
    plain_summary = summarize(runs | {"distributed": _records([4.0, 3.0, 2.0, 1.5], loads)},
                              plain, entropy_rate=1.4)  # fmt: skip
    assert len(summary_lines(plain_summary, plain)) == 3
    assert plain_summary.max_needed_buffer_factor is None
