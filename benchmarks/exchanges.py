"""The MoE layer's step with ``exchange="all_gather"`` against ``exchange="all_to_all"``.

For every preset of ``benchmarks/moe_layer.py`` (its default configuration, ``mixtral``,
``qwen3``, ``deepseek-v3``) and every layout (``ep2``: dp4 with EP over pairs of ranks,
``ep4``: EP over all four), 4 gloo processes build one layer, copy it, and parallelize the two
copies with ``parallelize_moe(..., exchange=...)``: the same weights, the same input and the same
upstream gradient on each rank. Per repeat, each layer's forward + backward runs once on every
rank between barriers, in alternating order; a repeat's ratio is the slowest rank's all-gather
step over the slowest rank's all-to-all step (wall), and the same for the process CPU time per
rank (every thread, gloo's included; on CPU with more ranks than cores, a step is bound by the
CPU time summed over ranks). Printed: the medians over repeats, with the quartiles of the
ratios. Before timing, the two layers' outputs are checked to agree.

Run::

    python benchmarks/exchanges.py                                   # every preset, EP2 and EP4
    python benchmarks/exchanges.py --presets qwen3 --layouts ep4 --repeats 41

Every other option is ``benchmarks/moe_layer.py``'s (``--tokens`` per rank, ``--dim``,
``--threads``, ``--warmup``, ``--repeats``, ``--capacity-factor``, ...), with the defaults given
there; ``--preset``, ``--layout`` and ``--pad-to-capacity`` (refused by the all-gather backend)
are not taken.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import socket
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import moe_layer  # noqa: E402  (this folder's benchmark: presets, layouts, inputs, timers)

EXCHANGES = ("all_gather", "all_to_all")  # numerator, denominator
LAYOUTS = ("ep2", "ep4")
DEFAULT = "default"  # moe_layer.py without --preset


def _preset_args(preset: str, rest: list[str]) -> argparse.Namespace:
    """``moe_layer.py``'s options for ``preset``, the other options ``rest``."""
    argv = sys.argv
    sys.argv = [argv[0], *rest, *(["--preset", preset] if preset != DEFAULT else [])]
    try:
        return moe_layer._parse()
    finally:
        sys.argv = argv


def _parse() -> tuple[argparse.Namespace, dict[str, argparse.Namespace]]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [DEFAULT, *sorted(moe_layer.PRESETS)]
    p.add_argument("--presets", default=",".join(names),
                   help=f"comma-separated, among {names} (default: all)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, among {list(LAYOUTS)} (default: both)")
    own, rest = p.parse_known_args()
    for flag in ("--preset", "--layout", "--pad-to-capacity"):
        if any(a == flag or a.startswith(f"{flag}=") for a in rest):
            p.error(f"{flag} is not taken here (see the module docstring)")
    own.presets, own.layouts = own.presets.split(","), own.layouts.split(",")
    for given, known, what in ((own.presets, names, "preset"), (own.layouts, LAYOUTS, "layout")):
        unknown = [g for g in given if g not in known]
        if unknown:
            p.error(f"unknown {what} {unknown}; choose among {list(known)}")
    presets = {preset: _preset_args(preset, rest) for preset in own.presets}
    first = next(iter(presets.values()))
    own.threads, own.world = first.threads, moe_layer.PARALLEL[LAYOUTS[0]].world
    return own, presets


def _layers(args: argparse.Namespace, layout: str) -> tuple[dict[str, Any], list, tuple]:
    """The layer of ``moe_layer.py`` and its copy, parallelized with each exchange; its input
    and upstream gradient on this rank."""
    from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

    spec = moe_layer.PARALLEL[layout]
    meshes = build_moe_meshes(**spec.meshes)
    moe, _, _ = moe_layer._build(args)
    layers = {name: copy.deepcopy(moe) for name in EXCHANGES}  # the same weights
    for name, layer in layers.items():
        parallelize_moe(layer, meshes, sequence_parallel=spec.sequence_parallel, exchange=name)
    x, grad_y = moe_layer._parallel_input(args, spec, meshes, moe_layer.DTYPES[args.dtype])
    params = [x, *(p for layer in layers.values() for p in layer.parameters())]
    return layers, params, (x, grad_y)


def _measure(args: argparse.Namespace, layout: str, world: int) -> dict[str, list]:
    """Per repeat, each layer's step once (order alternating), between barriers: the slowest
    rank's wall time and the mean process CPU time per rank, per exchange."""
    layers, params, (x, grad_y) = _layers(args, layout)
    with torch.no_grad():
        outputs = [layers[name](x) for name in EXCHANGES]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{layout}: the exchanges' outputs differ\n{m}")
    steps = {name: moe_layer._step_fn(layer, x, grad_y) for name, layer in layers.items()}
    times: dict[str, list] = {name: [] for name in EXCHANGES}
    for repeat in range(args.warmup + args.repeats):
        for name in EXCHANGES if repeat % 2 == 0 else EXCHANGES[::-1]:
            for p in params:
                p.grad = None  # as after optimizer.zero_grad(): no accumulation
            measured = moe_layer._timed_over_ranks(steps[name], world)
            if repeat >= args.warmup:
                times[name].append(measured)
    return times


def _worker(rank: int, own: argparse.Namespace, presets: dict, port: int, queue: Any) -> None:
    torch.set_num_threads(own.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=own.world
    )
    results = {}
    for layout in own.layouts:
        for preset, args in presets.items():
            results[preset, layout] = _measure(args, layout, own.world)
    if rank == 0:
        queue.put(results)
    dist.barrier()  # every rank tears its gloo connections down together
    dist.destroy_process_group()


def _run(own: argparse.Namespace, presets: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, own, presets, port, queue))
             for r in range(own.world)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=3600)
    finally:
        for p in procs:
            p.join()


def _ratio(num: list, den: list, which: int) -> str:
    ratios = [n[which] / d[which] for n, d in zip(num, den, strict=True)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    own, presets = _parse()
    results = _run(own, presets)
    first = next(iter(presets.values()))
    print(
        f"exchange all_gather / all_to_all, layer step (forward + backward): {own.world} gloo "
        f"processes x {first.threads} thread(s), tokens={first.tokens} per rank, "
        f"dim={first.dim}, dtype={first.dtype}, repeats={first.repeats}"
    )
    for (preset, layout), times in results.items():
        args = presets[preset]
        ag, a2a = times["all_gather"], times["all_to_all"]
        wall = {n: statistics.median(t[0] for t in times[n]) * 1e3 for n in EXCHANGES}
        print(
            f"preset={preset} layout={layout} experts={args.experts} top_k={args.top_k} "
            f"hidden={args.hidden} shared={args.shared}: all_gather {wall['all_gather']:.2f} ms, "
            f"all_to_all {wall['all_to_all']:.2f} ms; all_gather / all_to_all "
            f"{_ratio(ag, a2a, 0)}; process CPU per rank {_ratio(ag, a2a, 1)}"
        )


if __name__ == "__main__":
    main()
