"""The MoE layer's step against the same layer of another checkout, in the same processes.

``--baseline DIR`` names a checkout of the package (an older commit, for example made with
``git worktree add /tmp/old <commit>``). Its ``dtensor_moe`` is copied into a temporary folder
as ``dtensor_moe_baseline`` (every ``dtensor_moe`` in its sources renamed, custom-op namespace
included) and imported beside this checkout's package. Every rank builds both layers with the
same weights, the same input and the same upstream gradient, parallelizes each with its own
package, and times one forward + backward of each per repeat, in alternating order, between
barriers. Because both run in the same processes, on the same data, and next to each other in
time, a slow patch of the machine slows both: the per-repeat ratios are far less noisy than
ratios of separate runs.

Run::

    python benchmarks/against_baseline.py --baseline /tmp/old --layout ep4 --preset qwen3
    python benchmarks/against_baseline.py --baseline /tmp/old --preset deepseek-v3  # one process

Every other option is ``benchmarks/moe_layer.py``'s (``--layout``, ``--preset``, ``--tokens``,
``--repeats``, ...), with the defaults given there. Printed: the median over repeats of
``this / baseline`` for the slowest rank's step (wall) and for the process CPU time per rank
(every thread, gloo's included; on CPU with more ranks than cores, the step is bound by CPU time
summed over ranks), with the quartiles of the per-repeat ratios, and each side's medians.
"""

from __future__ import annotations

import importlib
import pathlib
import shutil
import socket
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import moe_layer  # noqa: E402  (this folder's benchmark: presets, layouts, inputs)

ALIAS = "dtensor_moe_baseline"


def _import_baseline(root: str) -> Any:
    """The package of checkout ``root`` under the name ``dtensor_moe_baseline``."""
    src = pathlib.Path(root) / "dtensor_moe"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--baseline {root}: no dtensor_moe package there ({src})")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="moe_baseline_"))
    shutil.copytree(src, folder / ALIAS, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (folder / ALIAS).rglob("*.py"):
        path.write_text(path.read_text().replace("dtensor_moe", ALIAS))
    sys.path.insert(0, str(folder))
    return importlib.import_module(ALIAS)


def _both_layers(args: Any, base: Any) -> tuple[torch.nn.Module, torch.nn.Module, tuple]:
    """This checkout's layer as ``moe_layer`` builds it, the baseline's with its weights, and
    ``moe_layer``'s one-process input and upstream gradient."""
    import dataclasses

    moe, x, grad_y = moe_layer._build(args)
    cfg, fields = moe.config, base.MoEConfig.__dataclass_fields__
    unknown = {f.name for f in dataclasses.fields(cfg) if f.name not in fields
               and getattr(cfg, f.name) != f.default}  # fmt: skip
    if unknown:
        raise SystemExit(f"the baseline's MoEConfig has no {sorted(unknown)}; leave them unset")
    other = base.MoE(base.MoEConfig(**{f: getattr(cfg, f) for f in fields if hasattr(cfg, f)}))
    mine, theirs = dict(moe.named_parameters()), dict(other.named_parameters())
    if mine.keys() != theirs.keys():
        raise SystemExit(f"the layers' parameters differ: {sorted(mine.keys() ^ theirs.keys())}")
    with torch.no_grad():
        for name, p in theirs.items():
            p.copy_(mine[name])
    return moe.to(args.device), other.to(args.device), (x, grad_y)


def _measure(args: Any, steps: dict[str, Any], params: list, sync: Any) -> dict[str, list]:
    """Per repeat, each step once (order alternating), through ``sync``: (wall, CPU) pairs."""
    times: dict[str, list] = {name: [] for name in steps}
    names = list(steps)
    for repeat in range(args.warmup + args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            for p in params:
                p.grad = None
            measured = sync(steps[name])
            if repeat >= args.warmup:
                times[name].append(measured)
    return times


def _worker(rank: int, args: Any, port: int, queue: Any) -> None:
    base = _import_baseline(args.baseline)
    layout = moe_layer.PARALLEL[args.layout]
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=layout.world
    )
    import dtensor_moe.parallel as par

    *layers, _ = _both_layers(args, base)
    options = dict(sequence_parallel=layout.sequence_parallel,
                   expert_tp_dispatch=layout.expert_tp_dispatch)  # fmt: skip
    meshes = par.build_moe_meshes(**layout.meshes)
    par.parallelize_moe(layers[0], meshes, **options)
    base.parallel.parallelize_moe(layers[1], base.parallel.build_moe_meshes(**layout.meshes),
                                  **options)  # fmt: skip
    x, grad_y = moe_layer._parallel_input(args, layout, meshes, moe_layer.DTYPES[args.dtype])
    steps = {name: moe_layer._step_fn(layer, x, grad_y) for name, layer in
             zip(("this", "baseline"), layers)}  # fmt: skip

    def sync(fn: Any) -> tuple[float, float]:
        return moe_layer._timed_over_ranks(fn, layout.world)

    params = [x, *layers[0].parameters(), *layers[1].parameters()]
    times = _measure(args, steps, params, sync)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def _run(args: Any) -> dict[str, list]:
    if args.layout == "single":
        base = _import_baseline(args.baseline)
        torch.set_num_threads(args.threads)
        *layers, (x, grad_y) = _both_layers(args, base)
        steps = {name: moe_layer._step_fn(layer, x, grad_y) for name, layer in
                 zip(("this", "baseline"), layers)}  # fmt: skip
        sync = moe_layer._timed_synced if args.device != "cpu" else moe_layer._timed_cpu
        return _measure(args, steps, [x, *layers[0].parameters(), *layers[1].parameters()], sync)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = moe_layer.rank_context(args.device)
    queue = ctx.Queue()
    world = moe_layer.PARALLEL[args.layout].world
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    times = queue.get()
    for p in procs:
        p.join()
    return times


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{statistics.median(values):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    argv = sys.argv[1:]
    if "--baseline" not in argv or argv.index("--baseline") + 1 >= len(argv):
        raise SystemExit("usage: against_baseline.py --baseline DIR [moe_layer.py options]")
    at = argv.index("--baseline")
    baseline = argv[at + 1]
    sys.argv = [sys.argv[0], *argv[:at], *argv[at + 2 :]]
    args = moe_layer._parse()
    args.baseline = str(pathlib.Path(baseline).resolve())
    if args.layout != "single" and args.layout not in moe_layer.PARALLEL:
        raise SystemExit(f"--layout {args.layout}: not a layout of benchmarks/moe_layer.py")
    times = _run(args)
    this, base = times["this"], times["baseline"]
    print(
        (f"preset={args.preset} " if args.preset else "")
        + f"layout={args.layout} tokens={args.tokens} dim={args.dim} hidden={args.hidden} "
        f"experts={args.experts} top_k={args.top_k} dtype={args.dtype} repeats={args.repeats} "
        f"baseline={args.baseline}"
    )
    for i, what in enumerate(("step (wall, slowest rank)", "process CPU per rank")):
        ratios = [t[i] / b[i] for t, b in zip(this, base)]
        print(
            f"{what}: this {statistics.median(t[i] for t in this) * 1e3:.2f} ms, baseline "
            f"{statistics.median(b[i] for b in base) * 1e3:.2f} ms; this / baseline "
            f"{_quartiles(ratios)}"
        )


if __name__ == "__main__":
    main()
