"""The benchmark scripts run on a clean checkout (tiny sizes; no timing is checked here).

``docs/benchmarks.md`` quotes their figures; this keeps the commands there working.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
# DTENSOR_MOE_FULL_MATRIX=1 adds the slower smoke runs, each named where it is left out
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


def _run(*args: str) -> str:
    """Run a script, which must succeed; its stdout. (A script's refusal of bad flags is
    checked in this process: :func:`_script_exit`.)"""
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_optimizer_step_benchmark_prints_every_case_and_mode():
    # CI: every case with all 4 ranks stepping at once; DTENSOR_MOE_FULL_MATRIX=1 adds the
    # script's default modes (one rank per core as well: 2 at once on 2 cores, the same
    # _timed_turns code with more turns)
    modes = [] if FULL else ["--concurrency", "4"]
    out = _run("benchmarks/optimizer_step.py", "--steps", "2", "--repeats", "1", *modes)
    lines = [line for line in out.splitlines() if "ranks stepping at once" in line]
    cases = {line.split(",")[0].strip() for line in lines}
    assert cases == {"200 x 64x64", "8 x 1024x1024"}, out
    assert all("| ratio " in line and "first step DTensor" in line for line in lines), out


def test_muon_step_benchmark_prints_both_layouts():
    out = _run("benchmarks/muon_step.py", "--dim", "32", "--layers", "1", "--steps", "1",
               "--warmup", "1", "--repeats", "1")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if line.strip()}
    assert rows.keys() == {"fsdp-ep", "tp"}, out
    assert all(len(cells) == 11 and float(cells[4]) > 0 for cells in rows.values()), out


# CI: ep2tp2, whose rank 0 prints the same lines and profile tables as the single process; the
# single process runs the same script in test_moe_layer_benchmark_presets and
# test_moe_layer_benchmark_capacity. DTENSOR_MOE_FULL_MATRIX=1 adds "single" here.
@pytest.mark.parametrize("layout", (["single"] if FULL else []) + ["ep2tp2"])
def test_moe_layer_benchmark_runs(layout):
    # The parallel run also takes the --free-exchanges diagnostic (one launch instead of two;
    # a real parallel step runs in test_moe_layer_benchmark_presets[ep4]).
    free = ["--free-exchanges"] if layout != "single" else []
    out = _run(
        "benchmarks/moe_layer.py", "--layout", layout, "--tokens", "64", "--dim", "32",
        "--hidden", "64", "--warmup", "1", "--repeats", "2", "--profile", "2", "--profile-rows", "40",
        *free,
    )
    assert f"layout={layout}" in out, out
    assert "step / floor (median of per-repeat ratios):" in out, out
    # --profile: one table for the step, one for the floor (rank 0's only, in a parallel layout)
    assert re.findall(r"^--- profile of (\w+): 2 calls; CPU time [\d.]+ ms per call$", out,
                      re.M) == ["step", "floor"], out
    assert "aten::_grouped_mm" in out, out
    assert ("free_exchanges (diagnostic: outputs are wrong)" in out) == bool(free), out
    if layout != "single":
        assert "process CPU per rank (all threads, mean over ranks, median): step " in out, out
        # ep2tp2's exchanges (counts, rows with their weights in one buffer, outputs;
        # backward: 2) are replayed alone
        assert "the step's 5 all-to-alls replayed alone: wall " in out, out


# CI: the preset in one process; DTENSOR_MOE_FULL_MATRIX=1 adds it under EP4 (about 20 s)
@pytest.mark.parametrize("layout", ["single"] + (["ep4"] if FULL else []))
def test_moe_layer_benchmark_presets(layout, monkeypatch, capsys):
    out = _run(
        "benchmarks/moe_layer.py", "--layout", layout, "--preset", "deepseek-v3", "--tokens",
        "64", "--dim", "32", "--warmup", "1", "--repeats", "2",
    )
    assert f"preset=deepseek-v3 layout={layout} tokens=64 dim=32 hidden=64 experts=256 " \
        "top_k=8 shared=1 " in out, out
    assert "step / floor (median of per-repeat ratios):" in out, out
    err = _moe_layer_parse_error(monkeypatch, capsys, "--preset", "qwen3", "--experts", "4")
    assert "--preset qwen3 sets --experts; leave them out" in err, err


# --compile's column (about 20 s): DTENSOR_MOE_FULL_MATRIX=1; the compiled layer itself is
# covered in CI by tests/test_parallel_compile.py
if FULL:

    def test_moe_layer_benchmark_compile_adds_a_compiled_column_without_recompiles():
        # aot_eager keeps this quick (inductor's C++ compile takes 15-30 s here); the figures in
        # docs/benchmarks.md use inductor, the default.
        out = _run(
            "benchmarks/moe_layer.py", "--layout", "ep2", "--compile", "--compile-backend",
            "aot_eager", "--tokens", "64", "--dim", "32", "--hidden", "64", "--warmup", "1",
            "--repeats", "2",
        )
        assert "torch.compile(moe): backend=aot_eager mode=default cache=fresh" in out, out
        for pattern in (
            r"eager step    \(fwd\+bwd, median\) \(slowest rank\): +\d+\.\d\d ms",
            r"compiled step \(fwd\+bwd, median\) \(slowest rank\): +\d+\.\d\d ms",
            r"compiled / eager \(median of per-repeat ratios\): \d+\.\d{3}",
            r"process CPU per rank \(median\): eager [\d.]+ ms, compiled [\d.]+ ms, compiled / "
            r"eager \d+\.\d{3}",
            r"first compiled step \(compile \+ run\) \(slowest rank\): \d+\.\d\d s",
        ):
            assert re.search(pattern, out), (pattern, out)
        dynamo = re.search(
            r"dynamo \(most on any rank\): (\d+) graphs, (\d+) graph breaks, recompiles during "
            r"the timed repeats: (\d+)",
            out,
        )
        assert dynamo, out
        # The experts' exchange is a deliberate break (docs/parallelism.md); the guards must hold.
        assert int(dynamo[1]) >= 1 and int(dynamo[2]) >= 1 and dynamo[3] == "0", out


def test_moe_layer_benchmark_capacity(monkeypatch, capsys):
    """The capacity flags of docs/benchmarks.md reach MoEConfig, and the padded layer compiles
    with the dropless layer's one break (the counter update). Under EP the same flags compile
    whole too (pinned in tests/test_capacity_dist.py; not rerun here, to keep CI short)."""
    out = _run(
        "benchmarks/moe_layer.py", "--capacity-factor", "1.25", "--pad-to-capacity", "--tokens",
        "64", "--dim", "32", "--hidden", "64", "--warmup", "1", "--repeats", "2", "--compile",
        "--compile-backend", "aot_eager",
    )
    assert "capacity_factor=1.25 pad_to_capacity" in out, out
    assert "step / floor (median of per-repeat ratios):" in out, out
    assert "1 graphs, 1 graph breaks, recompiles during the timed repeats: 0" in out, out
    err = _moe_layer_parse_error(monkeypatch, capsys, "--pad-to-capacity")
    assert "--pad-to-capacity needs --capacity-factor" in err, err


def _script_exit(monkeypatch, capsys, script: str, entry: str, *args: str) -> tuple:
    """Run ``benchmarks/<script>.py``'s ``entry`` (``main`` or ``_parse``) on ``args`` in this
    process, where it must stop with ``SystemExit``: its exit code (argparse's 2, or the message
    of a ``SystemExit(message)``, which ``python script.py`` prints to stderr with exit status
    1) and its stderr. No interpreter start (seconds each on 2 cores) for a refusal; each script
    also runs for real in its test above."""
    spec = importlib.util.spec_from_file_location(f"{script}_bench", ROOT / "benchmarks" /
                                                  f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    # against_baseline.py and exchanges.py import their neighbour moe_layer.py: put the folder
    # on the path, and have monkeypatch drop that module again afterwards
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    if "moe_layer" not in sys.modules:
        monkeypatch.setitem(sys.modules, "moe_layer", None)  # undo: delete the key
        del sys.modules["moe_layer"]
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        getattr(module, entry)()
    return exit_.value.code, capsys.readouterr().err


def _moe_layer_parse_error(monkeypatch, capsys, *args: str) -> str:
    """``benchmarks/moe_layer.py``'s argument check, in this process: its stderr when it
    refuses ``args`` with argparse's exit status 2."""
    code, err = _script_exit(monkeypatch, capsys, "moe_layer", "_parse", *args)
    assert code == 2, (code, err)
    return err


def test_device_flags_are_checked_before_running(monkeypatch, capsys):
    """The GPU runs of ``benchmarks/gpu.sh`` use these flags; here they fail cleanly."""
    for args, message in [
        (("--full-size",), "--full-size needs --preset"),
        (("--profile", "-1"), "--profile needs N >= 0 and --profile-rows >= 1"),
        (("--preset", "qwen3", "--full-size", "--dim", "64"),
         "--full-size sets --dim 2048; leave it out"),
    ]:
        err = _moe_layer_parse_error(monkeypatch, capsys, *args)
        assert message in err, (args, err)
    if not torch.cuda.is_available():
        for script in ("optimizer_step", "hf_block"):
            code, err = _script_exit(monkeypatch, capsys, script, "main", "--device", "cuda")
            assert code == 2 and "--device cuda is not available here" in err, (script, err)


def test_hf_block_benchmark_checks_parity_and_prints_ratios():
    out = _run(
        "benchmarks/hf_block.py", "--family", "deepseek_v3", "--tokens", "32", "--dim", "32",
        "--hidden", "16", "--experts", "16", "--top-k", "4", "--warmup", "1", "--repeats", "2",
        "--plain-routed-step",
    )
    assert "fused_routed_step=False" in out, out
    for impl in ("eager", "grouped_mm"):
        err = re.search(rf"parity HF {impl} vs ours: output rel err (\S+), x.grad rel err (\S+)",
                        out)
        assert err and max(float(err[1]), float(err[2])) < 1e-5, out
        assert re.search(rf"HF {impl}\s+[\d.]+\s+[\d.]+", out), out


@pytest.mark.parametrize(
    "layout", ["single"] + (["ep4"] if FULL else [])
)
def test_against_baseline_times_both_layers_in_one_run(layout, tmp_path, monkeypatch, capsys):
    # this checkout against itself: both packages are imported, built with the same weights and
    # stepped on the same data; the ratios are printed with their quartiles. CI runs "single"
    # (about 10 s); DTENSOR_MOE_FULL_MATRIX=1 adds the 4-process "ep4" (about 25 s)
    root = str(ROOT)
    out = _run(
        "benchmarks/against_baseline.py", "--baseline", root, "--layout", layout,
        "--tokens", "64", "--dim", "32", "--hidden", "64", "--warmup", "1", "--repeats", "3",
    )
    assert f"layout={layout}" in out and f"baseline={root}" in out, out
    for what in ("step (wall, slowest rank)", "process CPU per rank"):
        assert re.search(rf"^{re.escape(what)}: this [\d.]+ ms, baseline [\d.]+ ms; this / "
                         r"baseline [\d.]+ \(quartiles [\d.]+-[\d.]+\)$", out, re.M), out
    code, _ = _script_exit(monkeypatch, capsys, "against_baseline", "main", "--baseline",
                           str(tmp_path))  # fmt: skip
    assert f"--baseline {tmp_path}: no dtensor_moe package there" in str(code), code


def test_down_backward_benchmark_compares_the_four_variants():
    """``swiglu_down``'s formula against plain autograd and selective checkpointing: the same
    gradients (the script checks them), and what each keeps: ours and the recompute-all policy
    the pre-activations only, the other two more."""
    out = _run("benchmarks/down_backward.py", "--tokens", "64", "--dim", "32", "--warmup", "0",
               "--repeats", "1")  # fmt: skip
    line = r"^(\S+)\s+step\s+[\d.]+ ms\s+/ ours [\d.]+\s+kept for backward\s+([\d.]+) MiB$"
    kept = {m[1]: float(m[2]) for m in re.finditer(line, out, re.M)}
    assert set(kept) == {"ours", "plain", "sac-recompute", "sac-save-down"}, out
    assert kept["ours"] == kept["sac-recompute"] == round(2 * 64 * 8 * 96 * 4 / 2**20, 2), out
    assert kept["plain"] > kept["sac-save-down"] > kept["ours"], out


def test_exchanges_benchmark_prints_a_ratio_per_preset_and_layout(monkeypatch, capsys):
    # the fixed and all-to-all exchanges in the same 4 processes, one preset at EP4 (CI) and
    # SP2+EP2 (DTENSOR_MOE_FULL_MATRIX=1: a second layout of the same timing loop, about 15 s;
    # both exchanges under SP2 + EP2 are checked against one process in
    # tests/test_fixed_exchange.py)
    layouts = ["ep4", "sp2ep"] if FULL else ["ep4"]
    out = _run("benchmarks/exchanges.py", "--exchanges", "fixed,all_to_all", "--presets", "qwen3",
               "--layouts", ",".join(layouts), "--tokens", "32", "--dim", "16", "--warmup", "1",
               "--repeats", "2")  # fmt: skip
    assert out.startswith("exchange fixed / all_to_all, layer step (forward + backward): "
                          "4 gloo processes x 1 thread(s), tokens=32 per rank, dim=16, "), out
    assert out.splitlines()[0].endswith("buffer_factor=1.25"), out
    ratio = r"[\d.]+ \(quartiles [\d.]+-[\d.]+\)"
    lines = re.findall(rf"^preset=(\S+) layout=(\S+) experts=\d+ top_k=\d+ hidden=\d+ shared=\d+: "
                       rf"fixed [\d.]+ ms, all_to_all [\d.]+ ms; fixed / all_to_all "
                       rf"{ratio}; process CPU per rank {ratio}; saved for backward per rank "
                       rf"fixed [\d.]+ MiB, all_to_all [\d.]+ MiB; fixed buffer slots used "
                       rf"[\d.]+% \(the fullest pair\)$", out, re.M)  # fmt: skip
    assert lines == [("qwen3", layout) for layout in layouts], out
    code, err = _script_exit(monkeypatch, capsys, "exchanges", "_parse", "--pad-to-capacity")
    assert code == 2 and "--pad-to-capacity is not taken here" in err, err


def test_fixed_overflow_benchmark_prints_every_factor(monkeypatch, capsys):
    # one demo run (EP over 4 ranks, 3 steps of a small model) at the probe factor, then the
    # overflow count per factor from its recorded rows per rank pair (no second run)
    out = _run("benchmarks/fixed_overflow.py", "--steps", "3", "--layouts", "ep4",
               "--demo-args", "--layers 1 --dim 32 --batch 4 --seq-len 12")  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("fixed exchange overflow per buffer_factor: python -m "
                               "dtensor_moe.demo, 3 steps (--layers 1 --dim 32 --batch 4 "
                               "--seq-len 12), 4 gloo processes; one run per layout at "
                               "--buffer-factor 4 "), out  # fmt: skip
    head = re.fullmatch(r"layout ep4 \(--tp 1 --ep 4\): N=(\d+) rows per rank per forward, "
                        r"P=4 ranks; max needed factor steps 1-3 (\d\.\d{3}), steps 1-3 "
                        r"(\d\.\d{3}), all (\d\.\d{3}); demo run \d+ s, parity OK", lines[1])
    assert head and head[2] == head[3] == head[4], out  # 3 steps: both windows are all of them
    n, needed = int(head[1]), float(head[4])
    assert n == 1 * 12 * 2, out  # batch 4 over dp 4: 1 sequence per rank x 12 tokens x top-2
    factors = re.findall(r"^  buffer_factor (\d\.\d\d) \(C=(\d+) rows per pair\): overflowed "
                         r"(\d)/3 steps, first ([\d-]+), last ([\d-]+); --overflow rerun: (\d+) "
                         r"reruns?, factor ([\d.]+) at the end$", out, re.M)  # fmt: skip
    assert [f[0] for f in factors] == ["1.00", "1.25", "1.50", "2.00"] and len(lines) == 6, out
    for factor, c, over, first, last, reruns, _ in factors:
        # the fullest pair's rows (needed x N / P) fit C exactly when no step overflowed
        assert (int(over) == 0) == (needed * n / 4 <= int(c) + 1e-9), (factor, out)
        assert (first == "-") == (last == "-") == (over == "0") == (reruns == "0"), out
    code, err = _script_exit(monkeypatch, capsys, "fixed_overflow", "_parse", "--factors", "0.5")
    assert code == 2 and "--factors must each be >= 1.0, got [0.5]" in err, err
