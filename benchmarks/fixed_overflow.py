"""How often the fixed exchange's buffers overflow, per ``buffer_factor``, over the demo's training.

For each layout, the demo (``python -m dtensor_moe.demo``, 4 gloo processes, its default model,
data and 100 steps) runs ONCE with ``--exchange fixed --buffer-factor 4.0 --overflow strict``:
a buffer that large holds every row (``C >= N`` for ``P <= 4`` ranks), so nothing overflows and
the run follows the dropless trajectory, the one every factor trains on (an overflowed step is
run again before any optimizer step: ``--overflow rerun``). ``strict`` stops the probe if a row
ever did not fit. The demo records per step ``max_rows_per_pair``: the most rows one rank sent
one rank in one forward (any layer), with ``N`` (the rows each rank hands its exchange per
forward: tokens x top-k) and ``P`` (the exchange's ranks) in ``metrics.json``.

A step then overflows at factor ``F`` iff ``max_rows_per_pair > C(F)``, with the exchange's
rule (``FixedBufferExchange.rows_per_pair`` in ``dtensor_moe/routed/fixed.py``)::

    C(F) = max(8, ceil(ceil(F * N / P) / 8) * 8)

computed here in integers from the recorded counts (the probe run's own ``C(4.0)`` is checked
against this rule). Printed per layout: ``N``, ``P``, the largest needed factor (``rows * P /
N``) over the first 10 steps and over the last 10; per factor: ``C``, the steps that would
overflow at that factor (out of all), the first and the last of them, and what ``--overflow
rerun`` would do starting from it (each overflow reruns the step at 1.5x the factor, which then
stays: the reruns in all and the factor at the end).

Layouts (the demo's flags): ``ep4`` is ``--tp 1 --ep 4`` (data parallel over 4 ranks, the
experts split over all 4); ``sp2ep2`` is the demo's default ``--tp 2 --ep 2`` with sequence
parallelism (dp2 x tp2, EP borrowing the tp ranks), whose ``--seq-len 64`` tp divides.

Run::

    python benchmarks/fixed_overflow.py                      # both layouts, 100 steps
    python benchmarks/fixed_overflow.py --layouts ep4 --factors 1.1,1.2
    python benchmarks/fixed_overflow.py --steps 4 \
        --demo-args "--layers 1 --dim 32 --batch 4 --seq-len 12"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUTS = {  # name: the demo's layout flags (4 processes)
    "ep4": ["--tp", "1", "--ep", "4"],
    "sp2ep2": ["--tp", "2", "--ep", "2", "--sp"],
}
FACTORS = (1.0, 1.25, 1.5, 2.0)
PROBE_FACTOR = 4.0
GROW, MAX_TRIES = 1.5, 4  # step_without_overflow's defaults, which the demo uses
WINDOW = 10  # steps in the early and the late window
ALIGN = 8


def rows_per_pair(factor: float, n: int, p: int) -> int:
    """``C``: the buffer's rows per rank pair at ``factor`` for ``n`` rows over ``p`` ranks, as
    ``FixedBufferExchange.rows_per_pair`` computes it (the same float expression, then ints)."""
    share = math.ceil(factor * n / p)
    return max(ALIGN, -(-share // ALIGN) * ALIGN)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=100, help="training steps of the demo")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, among {list(LAYOUTS)} (default: all)")
    p.add_argument("--factors", default=",".join(map(str, FACTORS)),
                   help="comma-separated buffer factors to evaluate, each >= 1.0")
    p.add_argument("--probe-factor", type=float, default=PROBE_FACTOR,
                   help="the factor of the one demo run per layout; large enough that nothing "
                   "overflows (the run stops otherwise)")
    p.add_argument("--demo-args", default="",
                   help="more flags for the demo, for example a smaller model for a quick run")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="write the demo runs' outputs (metrics.json) under DIR and keep them")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    args.layouts = args.layouts.split(",")
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose among {list(LAYOUTS)}")
    try:
        args.factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        p.error(f"--factors must be comma-separated numbers, got {args.factors!r}")
    if not all(math.isfinite(f) and f >= 1.0 for f in args.factors):
        p.error(f"--factors must each be >= 1.0, got {args.factors}")
    if not (math.isfinite(args.probe_factor) and args.probe_factor >= 1.0):
        p.error(f"--probe-factor must be >= 1.0, got {args.probe_factor}")
    given = shlex.split(args.demo_args)
    owned = {"--exchange", "--buffer-factor", "--overflow", "--steps", "--out", "--nproc",
             "--tp", "--ep", "--dp"}  # fmt: skip
    clash = sorted(owned.intersection(a.split("=")[0] for a in given))
    if clash:
        p.error(f"--demo-args may not set {clash}: this script sets them")
    args.demo_args = given
    return args


def _probe(layout: str, args: argparse.Namespace, out: str) -> tuple[dict, float]:
    """Run the demo once for ``layout`` at the probe factor; its metrics and wall time."""
    cmd = [
        sys.executable, "-m", "dtensor_moe.demo", *LAYOUTS[layout], "--exchange", "fixed",
        "--buffer-factor", str(args.probe_factor), "--overflow", "strict",
        "--no-compare-balance", "--steps", str(args.steps), *args.demo_args, "--out", out,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(
            f"fixed_overflow.py: the demo failed for layout {layout} (exit {proc.returncode}): "
            f"{shlex.join(cmd[1:])}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f), wall


def _check(layout: str, metrics: dict, probe: float) -> tuple[int, int, list[int]]:
    """``(N, P, max rows per pair per step)`` of a probe run, after checking that it is one."""
    summary, steps = metrics["summary"], metrics["steps"]
    if not summary["parity_ok"]:
        sys.exit(f"fixed_overflow.py: layout {layout}: the demo's parity proof failed")
    n = metrics["fixed_exchange"]["routed_pairs_per_rank"]
    p = metrics["fixed_exchange"]["ep_ranks"]
    rows = [s["max_rows_per_pair"] for s in steps]
    c = rows_per_pair(probe, n, p)
    for s in steps:
        if s["rows_per_pair"] != c or s["reruns"] != 0 or s["buffer_factor"] != probe:
            sys.exit(
                f"fixed_overflow.py: layout {layout} step {s['step']}: the demo's buffer was "
                f"{s['rows_per_pair']} rows per pair at factor {s['buffer_factor']} with "
                f"{s['reruns']} reruns; expected {c} rows at {probe} and none"
            )
        if abs(s["max_rows_per_pair"] * p / n - s["needed_buffer_factor"]) > 1e-5:
            sys.exit(f"fixed_overflow.py: layout {layout} step {s['step']}: rows and needed "
                     "factor disagree")  # fmt: skip
    return n, p, rows


def _rerun_policy(rows: list[int], factor: float, n: int, p: int) -> tuple[int, float, int | None]:
    """What ``--overflow rerun`` does from ``factor``: the reruns in all, the factor at the end,
    and the step at which ``step_without_overflow`` would give up (``None``: it never does)."""
    reruns = 0
    for step, r in enumerate(rows, start=1):
        tries = 1
        while r > rows_per_pair(factor, n, p):
            if tries == MAX_TRIES:
                return reruns, factor, step
            factor *= GROW
            reruns += 1
            tries += 1
    return reruns, factor, None


def main() -> None:
    args = _parse()
    demo = shlex.join([*args.demo_args]) or "its defaults"
    print(
        f"fixed exchange overflow per buffer_factor: python -m dtensor_moe.demo, {args.steps} "
        f"steps ({demo}), 4 gloo processes; one run per layout at --buffer-factor "
        f"{args.probe_factor:g} (nothing overflows: the dropless trajectory), then per factor F "
        "a step overflows iff its max rows per rank pair exceed C(F) = max(8, ceil(ceil(F * N "
        "/ P) / 8) * 8)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep if args.keep is not None else tmp
        for layout in args.layouts:
            metrics, wall = _probe(layout, args, os.path.join(base, layout))
            n, p, rows = _check(layout, metrics, args.probe_factor)
            needed = [r * p / n for r in rows]
            w = min(WINDOW, len(rows))
            print(
                f"layout {layout} ({shlex.join(LAYOUTS[layout])}): N={n} rows per rank per "
                f"forward, P={p} ranks; max needed factor steps 1-{w} {max(needed[:w]):.3f}, "
                f"steps {len(rows) - w + 1}-{len(rows)} {max(needed[-w:]):.3f}, all "
                f"{max(needed):.3f}; demo run {wall:.0f} s, parity OK",
                flush=True,
            )
            for factor in args.factors:
                c = rows_per_pair(factor, n, p)
                over = [step for step, r in enumerate(rows, start=1) if r > c]
                first, last = (over[0], over[-1]) if over else ("-", "-")
                reruns, end, gave_up = _rerun_policy(rows, factor, n, p)
                policy = (
                    f"--overflow rerun: {reruns} rerun{'' if reruns == 1 else 's'}, factor "
                    f"{end:.4g} at the end"
                    if gave_up is None
                    else f"--overflow rerun: gives up at step {gave_up} ({MAX_TRIES} tries)"
                )
                print(
                    f"  buffer_factor {factor:.2f} (C={c} rows per pair): overflowed "
                    f"{len(over)}/{len(rows)} steps, first {first}, last {last}; {policy}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
