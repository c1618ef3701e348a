"""The MoE layer's step with one exchange backend against another.

``--exchanges NUM,DEN`` names the pair (default ``all_gather,all_to_all``; the fixed-buffer
exchange: ``fixed,all_to_all``, with ``--buffer-factor``, default 1.25). For every preset of
``benchmarks/moe_layer.py`` (its default configuration, ``mixtral``, ``qwen3``,
``deepseek-v3``) and every layout (``ep2``: dp4 with EP over pairs of ranks, ``ep4``: EP over all
four, ``sp2ep``: sequence parallel over tp2 with EP borrowing the tp ranks), 4 gloo processes
build one layer, copy it, and parallelize the two copies with ``parallelize_moe(...,
exchange=...)``: the same weights, the same input and the same upstream gradient on each rank.
Per repeat, each layer's forward + backward runs once on every rank between barriers, in
alternating order; a repeat's ratio is the slowest rank's NUM step over the slowest rank's DEN
step (wall), and the same for the process CPU time per rank (every thread, gloo's included; on
CPU with more ranks than cores, a step is bound by the CPU time summed over ranks). Printed: the
medians over repeats, with the quartiles of the ratios. Before timing, the two layers' outputs
are checked to agree.

``--compile`` adds a third column: ``torch.compile`` of the NUM layer (``--compile-backend``,
inductor by default), stepped in the same repeats, and its ratio to the eager DEN step. The
compiled layer runs one eager forward first (the fixed exchange agrees on its buffer size there).

Also printed per exchange: the bytes one training forward saves for backward, per rank (the
largest over ranks; ``benchmarks/moe_memory.py``'s count), and, for the fixed exchange, the
share of the fullest rank pair's ``C`` slots that held rows in the last forward.

The fixed exchange sends every peer its whole block of ``C`` rows, empty slots included, where
the all-to-all exchange sends the rows that exist and keeps this rank's own rows out of the
collective.

``--device cuda``: the 4 processes share one GPU (CUDA tensors, layers and inputs on the device)
and still talk over gloo, which copies every exchanged tensor through host memory (NCCL refuses
two ranks on one device); each timed step ends with a device synchronize. The ratio then shows
the layers' device work and their host reads (the all-to-all exchange reads its sizes on the
host in every forward and backward), not what NCCL on separate GPUs would give.

Run::

    python benchmarks/exchanges.py                                   # every preset, EP2 and EP4
    python benchmarks/exchanges.py --presets qwen3 --layouts ep4 --repeats 41
    python benchmarks/exchanges.py --exchanges fixed,all_to_all --layouts ep4,sp2ep --compile
    python benchmarks/exchanges.py --exchanges fixed,all_to_all --layouts ep4 --device cuda \
        --dtype bf16 --presets qwen3,deepseek-v3

Every other option is ``benchmarks/moe_layer.py``'s (``--tokens`` per rank, ``--dim``,
``--threads``, ``--warmup``, ``--repeats``, ``--capacity-factor``, ``--compile-backend``, ...),
with the defaults given there; ``--preset``, ``--layout`` and ``--pad-to-capacity`` (refused by
the all-gather and fixed backends) are not taken.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import moe_layer  # noqa: E402  (this folder's benchmark: presets, layouts, inputs, timers)
import moe_memory as moe_layer_memory  # noqa: E402  (this folder's count of saved bytes)

LAYOUTS = ("ep2", "ep4", "sp2ep")
DEFAULT_LAYOUTS = ("ep2", "ep4")
BACKENDS = ("all_gather", "all_to_all", "fixed")
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
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help=f"comma-separated, among {list(LAYOUTS)} (default: ep2,ep4)")
    p.add_argument("--exchanges", default="all_gather,all_to_all",
                   help=f"NUM,DEN: the two backends, among {list(BACKENDS)}")
    p.add_argument("--buffer-factor", type=float, default=1.25,
                   help="the fixed exchange's buffer_factor (default 1.25)")
    own, rest = p.parse_known_args()
    for flag in ("--preset", "--layout", "--pad-to-capacity"):
        if any(a == flag or a.startswith(f"{flag}=") for a in rest):
            p.error(f"{flag} is not taken here (see the module docstring)")
    own.presets, own.layouts = own.presets.split(","), own.layouts.split(",")
    own.exchanges = tuple(own.exchanges.split(","))
    if len(own.exchanges) != 2 or len(set(own.exchanges)) != 2 or any(
        e not in BACKENDS for e in own.exchanges
    ):
        p.error(f"--exchanges takes two different backends among {list(BACKENDS)}, "
                f"got {own.exchanges}")  # fmt: skip
    for given, known, what in ((own.presets, names, "preset"), (own.layouts, LAYOUTS, "layout")):
        unknown = [g for g in given if g not in known]
        if unknown:
            p.error(f"unknown {what} {unknown}; choose among {list(known)}")
    presets = {preset: _preset_args(preset, rest) for preset in own.presets}
    first = next(iter(presets.values()))
    own.threads, own.world = first.threads, moe_layer.PARALLEL[LAYOUTS[0]].world
    own.compile, own.device = first.compile, first.device
    return own, presets


def _layers(
    own: argparse.Namespace, args: argparse.Namespace, layout: str
) -> tuple[dict[str, Any], list, tuple]:
    """The layer of ``moe_layer.py`` and its copy, parallelized with each exchange; its input
    and upstream gradient on this rank."""
    from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

    spec = moe_layer.PARALLEL[layout]
    meshes = build_moe_meshes(**spec.meshes, device_type=args.device)
    moe, _, _ = moe_layer._build(args)
    layers = {name: copy.deepcopy(moe) for name in own.exchanges}  # the same weights
    for name, layer in layers.items():
        options = {"buffer_factor": own.buffer_factor} if name == "fixed" else None
        parallelize_moe(layer, meshes, sequence_parallel=spec.sequence_parallel, exchange=name,
                        exchange_options=options)  # fmt: skip
    x, grad_y = moe_layer._parallel_input(args, spec, meshes, moe_layer.DTYPES[args.dtype])
    params = [x, *(p for layer in layers.values() for p in layer.parameters())]
    return layers, params, (x, grad_y)


def _fill(layer: Any) -> float | None:
    """The share of the fixed exchange's fullest rank pair's slots used in the last forward."""
    from dtensor_moe.routed.fixed import FixedBufferExchange

    for module in layer.modules():
        exchange = getattr(getattr(module, "plan", None), "exchange", None)
        if isinstance(exchange, FixedBufferExchange):
            return exchange.last_fill
    return None


def _measure(
    own: argparse.Namespace, args: argparse.Namespace, layout: str, world: int
) -> dict[str, Any]:
    """Per repeat, each layer's step once (order alternating), between barriers: the slowest
    rank's wall time and the mean process CPU time per rank, per exchange (and the compiled
    NUM layer's); the bytes saved for backward, per exchange."""
    layers, params, (x, grad_y) = _layers(own, args, layout)
    num, den = own.exchanges
    with torch.no_grad():
        outputs = [layers[name](x) for name in own.exchanges]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{layout}: the exchanges' outputs differ\n{m}")
    fns = dict(layers)
    if own.compile:
        fns[f"{num} compiled"] = moe_layer._compiled(layers[num], args)
    steps = {name: moe_layer._step_fn(fn, x, grad_y) for name, fn in fns.items()}
    names = list(steps)
    times: dict[str, Any] = {name: [] for name in names}
    for repeat in range(args.warmup + args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            for p in params:
                p.grad = None  # as after optimizer.zero_grad(): no accumulation
            measured = moe_layer._timed_over_ranks(steps[name], world, synced=args.device != "cpu")
            if repeat >= args.warmup:
                times[name].append(measured)
    saved = {}
    for name in own.exchanges:
        params_of = [p.to_local() if hasattr(p, "to_local") else p
                     for p in layers[name].parameters()]  # fmt: skip
        out, counted = moe_layer_memory.saved_bytes(lambda n=name: layers[n](x), params_of)
        del out
        largest = torch.tensor([counted.activations])
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        saved[name] = int(largest)
    fill = _fill(layers[num]) if num == "fixed" else _fill(layers[den])
    if fill is not None:
        fill_t = torch.tensor([fill])
        dist.all_reduce(fill_t, op=dist.ReduceOp.MAX)
        fill = float(fill_t)
    return {"times": times, "saved": saved, "fill": fill}


def _worker(rank: int, own: argparse.Namespace, presets: dict, port: int, queue: Any) -> None:
    torch.set_num_threads(own.threads)
    if own.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=own.world
    )
    results = {}
    for layout in own.layouts:
        for preset, args in presets.items():
            results[preset, layout] = _measure(own, args, layout, own.world)
    if rank == 0:
        queue.put(results)
    dist.barrier()  # every rank tears its gloo connections down together
    dist.destroy_process_group()


def _run(own: argparse.Namespace, presets: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = moe_layer.rank_context(own.device)
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
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    own, presets = _parse()
    results = _run(own, presets)
    first = next(iter(presets.values()))
    num, den = own.exchanges
    factor = f", buffer_factor={own.buffer_factor}" if "fixed" in own.exchanges else ""
    print(
        f"exchange {num} / {den}, layer step (forward + backward): {own.world} gloo "
        f"processes x {first.threads} thread(s), tokens={first.tokens} per rank, "
        f"dim={first.dim}, dtype={first.dtype}, repeats={first.repeats}{factor}"
        + (f", device {first.device} ({torch.cuda.get_device_name()}, shared by every rank)"
           if first.device == "cuda" else "")
    )
    for (preset, layout), result in results.items():
        args, times = presets[preset], result["times"]
        wall = {n: statistics.median(t[0] for t in times[n]) * 1e3 for n in times}
        line = (
            f"preset={preset} layout={layout} experts={args.experts} top_k={args.top_k} "
            f"hidden={args.hidden} shared={args.shared}: "
            + ", ".join(f"{n} {w:.2f} ms" for n, w in wall.items())
            + f"; {num} / {den} {_ratio(times[num], times[den], 0)}; process CPU per rank "
            f"{_ratio(times[num], times[den], 1)}"
        )
        if own.compile:
            compiled = times[f"{num} compiled"]
            line += (f"; {num} compiled / {den} eager {_ratio(compiled, times[den], 0)}, CPU "
                     f"{_ratio(compiled, times[den], 1)}")  # fmt: skip
        saved = result["saved"]
        line += "; saved for backward per rank " + ", ".join(
            f"{n} {b / 2**20:.2f} MiB" for n, b in saved.items()
        )
        if result["fill"] is not None:
            line += f"; fixed buffer slots used {result['fill']:.1%} (the fullest pair)"
        print(line)


if __name__ == "__main__":
    main()
