"""MoE layer forward+backward step time against its expert-compute floor, side by side.

Shape legend: T tokens, D dim, R routed rows, e local experts.

The *floor* is ``grouped_swiglu`` forward+backward on exactly the routed rows and per-expert
counts that the layer produced, with the compute path the layer resolves to. ``step / floor``
is the cost of routing, dispatch and combine (and shared experts when enabled) on top of the
expert math. Step and floor are timed alternately in every repeat; medians are reported.

Run::

    python benchmarks/moe_layer.py                 # layout "single": one process
    python benchmarks/moe_layer.py --shared 1      # with one shared expert
    python benchmarks/moe_layer.py --layout ep4    # 4 gloo processes x 1 thread
    python benchmarks/moe_layer.py --layout ep4 --compile  # + torch.compile(moe), side by side
    python benchmarks/moe_layer.py --preset deepseek-v3    # also mixtral, qwen3; any layout
    python benchmarks/moe_layer.py --capacity-factor 1.25 --pad-to-capacity  # token dropping
    python benchmarks/moe_layer.py --layout ep4 --balanced  # forced perfect balance (debug)
    python benchmarks/moe_layer.py --device cuda --dtype bf16   # one GPU (layout single)

Layouts: ``--layout`` picks an entry of ``LAYOUTS``. The parallel layouts (``PARALLEL``) launch
``world`` gloo processes with ``--threads`` threads each; every rank routes ``--tokens``
tokens. Their floor is ``grouped_swiglu`` on exactly the rows that rank's experts received,
with its local weight shards. Per repeat, step and floor are each timed on every rank between
barriers; the repeat's ratio is (slowest rank's step) / (slowest rank's floor), and the
reported figures are medians over repeats.

The parallel layouts also print an account of CPU time, because on CPU, with more ranks than
cores, a step is bound by CPU time summed over ranks rather than by any one rank's critical
path: the process CPU time (every thread, gloo's included) of step and floor, per rank, and
the process CPU time of the step's all-to-alls alone. Those are the ``all_to_all_single`` calls of
the expert-parallel exchanges (not the all-gathers and reduce-scatters of a ``gather``
layout), replayed at the sizes and in the order that one step issued them, between the same
barriers, with no expert math around them. When every core is busy, ``exchanges / floor`` is
what they add to ``step / floor`` however well they overlap.

``--compile`` adds a compiled column: the same layer under ``torch.compile(moe)`` (backend
``--compile-backend``, inductor by default), stepped in every repeat next to the eager step, in
alternating order. It prints both medians, the median of per-repeat ``compiled / eager``
ratios, the first compiled step (compilation included) on its own, and dynamo's counts: graphs,
graph breaks, and the frames it compiled again during the timed repeats (recompiles; 0 when
the guards hold). ``--compile-cache fresh`` compiles into an empty inductor cache, as a first
run does; ``default`` reuses torch's cache directory, as later runs do.

``--profile N`` runs ``N`` more steps and ``N`` floors under ``torch.profiler`` after the timed
repeats, and prints each one's operators by self time (device time on an accelerator, CPU time
otherwise), per step, with the count of device kernels per step: where ``step - floor`` goes.
In a parallel layout every rank profiles the same calls and rank 0 prints its tables (its waits
on the other ranks included, as ``wait``/collective rows).

``--free-exchanges`` is a diagnostic for the parallel layouts: the expert-parallel
all-to-alls become local copies, as if every rank received exactly the rows it sent.
The outputs are wrong, but the work is that of a symmetric exchange, so the ratio shows what
the layer costs without the exchanges themselves (``docs/benchmarks.md``).

``--balanced`` builds the layer with ``MoEConfig(force_balanced_routing=True)``, in every
layout: each rank sends its tokens to the experts round-robin, so every expert gets the same
number of rows and every exchange is equal. The outputs are not the model's; the figures are
the best case of perfect balance (``docs/moe.md``, "Balanced routing for benchmarking").
"""

# ruff: noqa: N806

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor_moe.moe import MoE, MoEConfig
from dtensor_moe.routed import grouped_swiglu, permute_tokens, resolve_compute_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# --preset: the routing of three real model families with their widths scaled down for a CPU
# (dim 256, the default; --full-size takes the model's own dim and hidden, for a GPU): the
# expert count, top-k, score function, normalisation, scaling, group-limited routing, expert
# bias and shared experts are the models'; each expert's hidden size keeps the model's
# moe_intermediate / dim ratio. The sizes are flags, so an explicit
# --experts/--top-k/--hidden/--shared after the preset is refused rather than mixed in.
PRESETS: dict[str, dict] = {
    # Mixtral 8x7B: dim 4096, hidden 14336, softmax over the 8 experts, top-2, renormalised
    "mixtral": dict(experts=8, top_k=2, hidden=896, shared=0, full=dict(dim=4096, hidden=14336),
                    config=dict(score_func="softmax", route_norm=True)),
    # Qwen3-30B-A3B: dim 2048, moe_intermediate 768, 128 experts, top-8, norm_topk_prob
    "qwen3": dict(experts=128, top_k=8, hidden=96, shared=0, full=dict(dim=2048, hidden=768),
                  config=dict(score_func="softmax", route_norm=True)),
    # DeepSeek-V3: dim 7168, moe_intermediate 2048, 256 experts in 8 groups of which a token
    # may use 4, top-8, sigmoid scores with a correction bias, renormalised, scaled by 2.5,
    # one shared expert of the same width
    "deepseek-v3": dict(experts=256, top_k=8, hidden=64, shared=1,
                        full=dict(dim=7168, hidden=2048),
                        config=dict(score_func="sigmoid", route_norm=True, route_scale=2.5,
                                    num_expert_groups=8, num_limited_groups=4,
                                    use_expert_bias=True)),
}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _build(args: argparse.Namespace) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = MoEConfig(
        dim=args.dim,
        hidden_dim=args.hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        num_shared_experts=args.shared,
        compute_path=args.path,
        fused_routed_step=not args.plain_routed_step,
        capacity_factor=args.capacity_factor,
        capacity_per_expert=args.capacity_per_expert,
        pad_to_capacity=args.pad_to_capacity,
        force_balanced_routing=args.balanced,
        **PRESETS[args.preset]["config"] if args.preset else {},
    )
    dtype = DTYPES[args.dtype]
    if args.full_size and args.device != "cpu":  # made on the device, in its dtype: no copies
        moe = MoE(config, device=args.device, dtype=dtype)
    else:
        moe = MoE(config).to(device=args.device, dtype=dtype)  # the same weights everywhere
    x = torch.randn(1, args.tokens, args.dim, dtype=dtype).to(args.device).requires_grad_()
    grad_y = torch.randn(1, args.tokens, args.dim, dtype=dtype).to(args.device)
    return moe, x, grad_y


def _routed_rows(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed buffer and counts the layer feeds its experts, as detached leaves."""
    with torch.no_grad():
        x_TD = x.reshape(-1, x.shape[-1])
        routing = moe.router(x_TD)
        routed = moe.experts.exchange.dispatch(
            x_TD, routing.topk_scores_TK, routing.topk_ids_TK, routing.counts_E, routing.capacity
        )
        routed_RD = permute_tokens(x_TD, routed.layout)
    return routed_RD.clone().requires_grad_(), routed.layout.counts_e


def _timed_cpu(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall time and process CPU time (every thread) of one call."""
    cpu = time.process_time()
    wall = _timed(fn)
    return wall, time.process_time() - cpu


def _timed_synced(fn: Callable[[], None]) -> tuple[float, float]:
    """:func:`_timed_cpu` of ``fn`` on an accelerator: the device's queue is drained before the
    clock starts and inside the timed call, so the time is that of the kernels ``fn`` queued."""
    torch.accelerator.synchronize()

    def run() -> None:
        fn()
        torch.accelerator.synchronize()

    return _timed_cpu(run)


def _timed_over_ranks(
    fn: Callable[[], None], world: int, *, synced: bool = False
) -> tuple[float, float]:
    """One call of ``fn`` on every rank, between barriers: the slowest rank's wall time, and the
    process CPU time (all threads) averaged over the ``world`` ranks; ``synced``: the ranks'
    device work included (:func:`_timed_synced`)."""
    dist.barrier()
    wall, cpu = (_timed_synced if synced else _timed_cpu)(fn)
    wall, cpu = torch.tensor([wall]), torch.tensor([cpu])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu) / world


def _step_fn(layer: Callable, x: torch.Tensor, grad_y: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``layer`` (the eager ``MoE`` or ``torch.compile`` of it)."""

    def step() -> None:
        y = layer(x)
        (y.to_local() if hasattr(y, "to_local") else y).backward(grad_y)

    return step


def _compiled(moe: MoE, args: argparse.Namespace) -> Callable:
    """``torch.compile(moe)`` as ``--compile-backend`` / ``--compile-mode`` say."""
    mode = None if args.compile_mode == "default" else args.compile_mode
    # Set in every process that compiles (the ranks): one break per eager region, not one per
    # Python frame around it (docs/parallelism.md, torch.compile).
    torch._dynamo.config.nested_graph_breaks = args.nested_graph_breaks
    return torch.compile(moe, backend=args.compile_backend, mode=mode)


def _measure(
    timer: Callable[[Callable[[], None]], tuple[float, float]],
    args: argparse.Namespace,
    fns: dict[str, Callable[[], None]],
) -> dict[str, object]:
    """``args.warmup`` untimed rounds, then ``args.repeats`` rounds timing each of ``fns`` once.

    With a ``"compiled"`` entry, its first call (compilation included) is timed alone, before
    the warm-up, and ``"step"`` and ``"compiled"`` swap places every other round, so that
    neither always runs in the caches the other left. ``recompiles`` counts the frames dynamo
    converted during the timed rounds: a cache hit converts none.
    """
    from torch._dynamo.utils import counters

    first = timer(fns["compiled"]) if "compiled" in fns else (float("nan"), float("nan"))
    for _ in range(args.warmup):
        for fn in fns.values():
            timer(fn)
    frames = counters["frames"]["total"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for i in range(args.repeats):
        names = list(fns)
        if i % 2 and "compiled" in fns:
            a, b = names.index("step"), names.index("compiled")
            names[a], names[b] = names[b], names[a]
        for name in names:
            times[name].append(timer(fns[name]))
    return {
        "times": times,
        "first_compiled": first,
        "dynamo": [
            counters["frames"]["total"] - frames,  # recompiles during the timed rounds
            counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()),
        ],
    }


def _medians(times: dict[str, list[tuple[float, float]]], which: int) -> dict[str, float]:
    """Median ms of each entry, and median per-repeat ratios to the eager step and the floor.

    ``which`` picks wall time (0) or CPU time (1) from the ``(wall, cpu)`` pairs.
    """
    out = {f"{n}_ms": 1e3 * statistics.median(t[which] for t in ts) for n, ts in times.items()}
    ratios = ("step", "floor"), ("compiled", "floor"), ("compiled", "step"), ("exchanges", "floor")
    for num, den in ratios:
        if num in times and den in times:
            pairs = zip(times[num], times[den])
            out[f"{num}/{den}"] = statistics.median(n[which] / d[which] for n, d in pairs)
    return out


def _compile_result(measured: dict[str, object]) -> dict[str, object]:
    recompiles, graphs, breaks = measured["dynamo"]
    return {
        "compile_s": measured["first_compiled"][0],
        "recompiles": int(recompiles),
        "graphs": int(graphs),
        "graph_breaks": int(breaks),
    }


def run_single(args: argparse.Namespace) -> dict[str, object]:
    """One process: the layer step and the expert floor, alternately, ``args.repeats`` times
    (with ``--compile``, the compiled layer's step too)."""
    moe, x, grad_y = _build(args)
    routed_RD, counts_e = _routed_rows(moe, x)
    ex = moe.experts
    path = resolve_compute_path(args.path, routed_RD, ex.w1, counts_e.tolist())
    grad_RD = torch.randn_like(routed_RD)

    def floor() -> None:
        grouped_swiglu(routed_RD, ex.w1, ex.w2, ex.w3, counts_e, path).backward(grad_RD)

    fns = {"step": _step_fn(moe, x, grad_y)}
    if args.compile:
        fns["compiled"] = _step_fn(_compiled(moe, args), x, grad_y)
    timer = _timed_cpu if args.device == "cpu" else _timed_synced
    measured = _measure(timer, args, {**fns, "floor": floor})
    if args.profile:
        _profile(args, {"step": fns["step"], "floor": floor})
    wall = _medians(measured["times"], 0)
    result = {
        "path": path,
        "counts": counts_e.tolist(),
        "step_ms": wall["step_ms"],
        "floor_ms": wall["floor_ms"],
        "ratio": wall["step/floor"],
    }
    if args.compile:
        result |= _compile_result(measured) | {
            "compiled_ms": wall["compiled_ms"],
            "compiled_ratio": wall["compiled/step"],
            "compiled_floor_ratio": wall["compiled/floor"],
        }
    return result


def _profile(
    args: argparse.Namespace, fns: dict[str, Callable[[], None]], show: bool = True
) -> None:
    """``--profile``: each of ``fns`` run ``args.profile`` times under ``torch.profiler``; prints
    the operators by self time per call, and the device kernels per call. Every rank of a
    parallel layout profiles the same calls (their collectives pair up); ``show``: this rank
    prints its tables (rank 0's)."""
    from torch.profiler import ProfilerActivity, profile

    on_device = args.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    for name, fn in fns.items():
        fn()  # outside the profile: nothing of the previous entry's is still queued
        if on_device:
            torch.accelerator.synchronize()
        if dist.is_initialized():
            dist.barrier()  # the ranks enter together: no rank's wait for a late one is profiled
        with profile(activities=activities) as prof:
            for _ in range(args.profile):
                fn()
            if on_device:
                torch.accelerator.synchronize()
        if not show:
            continue
        # The operators' own time: on a device, the kernels each operator launched (the table's
        # kernel rows repeat those, so only operators, the host-side events, are summed).
        ops = [e for e in prof.events() if str(e.device_type).endswith("CPU")]
        total = sum(getattr(e, key) for e in ops) / args.profile / 1e3
        print(f"--- profile of {name}: {args.profile} calls; {'device' if on_device else 'CPU'} "
              f"time {total:.2f} ms per call")
        events = prof.key_averages()
        if on_device:  # kernels and copies: events that ran on the device
            kernels = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))
            print(f"device kernels and copies per call: {kernels / args.profile:.0f}")
        print(events.table(sort_by=key, row_limit=args.profile_rows, max_name_column_width=60))


@dataclass(frozen=True)
class ParallelLayout:
    """A parallel layout: ``build_moe_meshes`` arguments and ``parallelize_moe`` options."""

    meshes: dict
    sequence_parallel: bool
    expert_tp_dispatch: str = "all_to_all"
    world: int = 4


PARALLEL: dict[str, ParallelLayout] = {
    "ep4": ParallelLayout({"dp": 4, "ep": 4}, False),  # dp2ep
    "ep2": ParallelLayout({"dp": 4, "ep": 2}, False),
    "ep2tp2": ParallelLayout({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, True),
    "ep2tp2_gather": ParallelLayout({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, True, "gather"),
    "etp2": ParallelLayout({"dp": 2, "ep": 1, "tp": 2, "expert_tp": True}, True),
    "sp2ep": ParallelLayout({"dp": 2, "ep": 2, "tp": 2}, True),  # EP borrows the tp ranks
    "sp2ep4": ParallelLayout({"dp": 2, "ep": 4, "tp": 2}, True),
    "tp2ep": ParallelLayout({"dp": 2, "ep": 2, "tp": 2}, False),  # replicated input, 1/tp each
}


def _parallel_input(args, layout: ParallelLayout, meshes, dtype) -> tuple[torch.Tensor, ...]:
    """This rank's MoE input and upstream gradient; every rank routes ``args.tokens`` tokens.

    Under tp, a data-parallel group holds one sequence of ``tokens * tp`` tokens: a
    ``Shard(1)`` DTensor (each tp rank routes its shard) or a ``Replicate()`` one (each routes a
    ``1/tp`` slice).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = meshes.tp
    torch.manual_seed(1 + dist.get_rank() // tp)
    x = torch.randn(1, args.tokens * tp, args.dim, dtype=dtype)
    x, grad_y = x.to(args.device), torch.randn_like(x).to(args.device)  # drawn on the CPU
    if tp == 1:
        return x.requires_grad_(), grad_y
    placement = [Shard(1) if layout.sequence_parallel else Replicate()]
    mesh = meshes.dense["tp"]
    x = distribute_tensor(x, mesh, placement).requires_grad_()
    return x, distribute_tensor(grad_y, mesh, placement).to_local()


def _captured_rows(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed rows and counts that reach this rank's experts in one forward (the received
    rows and the own rows together, grouped by local expert)."""
    import dtensor_moe.routed.experts as plan_module

    seen = []
    finish = plan_module.finish  # every expert computation ends there (own and received rows)

    def capture(started, weights):
        rows_RD = permute_tokens(started.source, started.layout).detach()
        seen.append((rows_RD, started.layout.counts_e.tolist()))
        return finish(started, weights)

    plan_module.finish = capture
    try:
        with torch.no_grad():
            moe(x)
    finally:
        plan_module.finish = finish
    groups, counts = [], []
    for j in range(len(seen[0][1])):
        parts = [rows.split(c)[j] for rows, c in seen]
        groups += parts
        counts.append(sum(p.shape[0] for p in parts))
    return torch.cat(groups).clone(), torch.tensor(counts, dtype=torch.int64)


class _Done:
    def wait(self) -> None:
        pass


class _DistProxy:
    """``torch.distributed`` as the dispatch module sees it, but for ``all_to_all_single``,
    which a subclass replaces (the benchmark sets it as ``dispatch.dist``).
    """

    def __getattr__(self, name: str):
        return getattr(dist, name)


class _LocalExchanges(_DistProxy):
    """``all_to_all_single`` replaced by a local copy: see ``--free-exchanges``. Every rank then
    "receives" exactly the rows it sent, so the counts agree and the step does the work of a
    perfectly symmetric exchange, without the exchange.
    """

    @staticmethod
    def all_to_all_single(output, input, *args, **kwargs) -> _Done:  # noqa: A002
        output.copy_(input)
        return _Done()


class _RecordedExchanges(_DistProxy):
    """Records every ``all_to_all_single`` it passes on to ``torch.distributed``: buffers of the
    same shapes and dtypes, the split sizes and the group, to replay them alone.
    """

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def all_to_all_single(self, output, input, out_splits=None, in_splits=None, group=None, **kw):
        sizes = [None if splits is None else list(splits) for splits in (out_splits, in_splits)]
        self.calls.append((torch.empty_like(output), torch.zeros_like(input), *sizes, group))
        return dist.all_to_all_single(output, input, out_splits, in_splits, group=group, **kw)


def _parallel_worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    from dtensor_moe.routed import local_expert_weight
    from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

    layout = PARALLEL[args.layout]
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=layout.world
    )
    meshes = build_moe_meshes(**layout.meshes)
    moe, _, _ = _build(args)
    parallelize_moe(
        moe,
        meshes,
        sequence_parallel=layout.sequence_parallel,
        expert_tp_dispatch=layout.expert_tp_dispatch,
        ep_overlap=not args.no_overlap,
    )
    x, grad_y = _parallel_input(args, layout, meshes, DTYPES[args.dtype])
    routed_RD, counts_e = _captured_rows(moe, x)
    routed_RD.requires_grad_()
    ex = moe.experts
    w1, w2, w3 = (local_expert_weight(w).detach().requires_grad_() for w in (ex.w1, ex.w2, ex.w3))
    path = resolve_compute_path(args.path, routed_RD, w1, counts_e.tolist())
    grad_RD = torch.randn_like(routed_RD)
    import dtensor_moe.routed.all_to_all as exchange_module

    step = _step_fn(moe, x, grad_y)
    recorder = _RecordedExchanges()
    exchange_module.dist = recorder
    try:
        step()
    finally:
        exchange_module.dist = dist
    if args.free_exchanges:
        exchange_module.dist = _LocalExchanges()

    def exchanges() -> None:
        for out, inp, out_splits, in_splits, group in recorder.calls:
            dist.all_to_all_single(
                out, inp, out_splits, in_splits, group=group, async_op=True
            ).wait()

    def floor() -> None:
        grouped_swiglu(routed_RD, w1, w2, w3, counts_e, path).backward(grad_RD)

    def synced(fn: Callable[[], None]) -> tuple[float, float]:
        for t in (x, routed_RD, w1, w2, w3, *moe.parameters()):
            t.grad = None  # as after optimizer.zero_grad(): no accumulation in either
        return _timed_over_ranks(fn, layout.world)

    fns = {"step": step}
    if args.compile:
        fns["compiled"] = _step_fn(_compiled(moe, args), x, grad_y)
    measured = _measure(synced, args, {**fns, "floor": floor, "exchanges": exchanges})
    dynamo = torch.tensor(measured["dynamo"])
    dist.all_reduce(dynamo, op=dist.ReduceOp.MAX)  # the most any rank saw
    measured["dynamo"] = dynamo.tolist()
    rows = torch.tensor([routed_RD.shape[0]])
    all_rows = [torch.zeros_like(rows) for _ in range(layout.world)]
    dist.all_gather(all_rows, rows)
    if args.profile:
        _profile(args, {"step": step, "floor": floor}, show=rank == 0)
    if rank == 0:
        queue.put(_parallel_result(args, measured, path, [int(r) for r in all_rows], recorder))
    dist.barrier()  # every rank tears its gloo connections down together
    dist.destroy_process_group()


def _parallel_result(args, measured, path, rows, recorder) -> dict[str, object]:
    """The figures ``main`` prints, from rank 0's (already rank-reduced) measurements."""
    wall, cpu = _medians(measured["times"], 0), _medians(measured["times"], 1)
    result = {
        "path": path,
        "counts": rows,
        "step_ms": wall["step_ms"],
        "floor_ms": wall["floor_ms"],
        "ratio": wall["step/floor"],
        "cpu_step_ms": cpu["step_ms"],
        "cpu_floor_ms": cpu["floor_ms"],
        "cpu_ratio": cpu["step/floor"],
        "exchanges": len(recorder.calls),
        "exchanges_ms": wall["exchanges_ms"],
        "cpu_exchanges_ms": cpu["exchanges_ms"],
        "cpu_exchanges_share": cpu["exchanges/floor"],
    }
    if args.compile:
        result |= _compile_result(measured) | {
            "compiled_ms": wall["compiled_ms"],
            "compiled_ratio": wall["compiled/step"],
            "compiled_floor_ratio": wall["compiled/floor"],
            "cpu_compiled_ms": cpu["compiled_ms"],
            "cpu_compiled_ratio": cpu["compiled/step"],
        }
    return result


def run_parallel(args: argparse.Namespace) -> dict[str, object]:
    """``world`` gloo processes, one layout; see the module docstring."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = rank_context(args.device)  # _parse keeps the parallel layouts on CPU
    queue = ctx.Queue()
    world = PARALLEL[args.layout].world
    procs = [
        ctx.Process(target=_parallel_worker, args=(r, args, port, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=1800)
    finally:
        for p in procs:
            p.join()
    return result


LAYOUTS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {
    "single": run_single,
    **{name: run_parallel for name in PARALLEL},
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="single")
    p.add_argument("--plain-routed-step", action="store_true",
                   help="MoEConfig(fused_routed_step=False): plain autograd, no extra matmul")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a real model's routing, scaled down (sets experts, top-k, hidden, shared)")
    p.add_argument("--full-size", action="store_true",
                   help="with --preset: the model's own dim and hidden (for a GPU; deepseek-v3's "
                        "layer takes about 45 GiB with its grads in bf16)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="MoEConfig.capacity_factor: drop pairs over capacity (default dropless)")
    p.add_argument("--capacity-per-expert", type=int, default=None,
                   help="MoEConfig.capacity_per_expert: a fixed capacity instead of a factor")
    p.add_argument("--pad-to-capacity", action="store_true",
                   help="MoEConfig.pad_to_capacity: static shapes (needs a capacity)")
    p.add_argument("--balanced", action="store_true",
                   help="MoEConfig(force_balanced_routing=True): every expert gets the same "
                        "number of tokens (debug mode: outputs are not the model's)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared", type=int, default=0, help="number of shared experts")
    p.add_argument("--path", default="auto", choices=["auto", "grouped_mm", "loop", "bmm"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu",
                   help="layout single only: where the layer runs, e.g. cuda (default cpu)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more steps and floors with torch.profiler (parallel layouts: "
                        "every rank runs them, rank 0 prints its tables)")
    p.add_argument("--profile-rows", type=int, default=30,
                   help="operators printed per --profile table")
    p.add_argument(
        "--free-exchanges",
        action="store_true",
        help="diagnostic, parallel layouts only: the expert-parallel "
        "all-to-alls become local copies (outputs are wrong; the work is that of a symmetric "
        "exchange), to show what the exchanges themselves cost",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="parallel layouts: every row through the exchange, the own rows included, none "
        "computed while the outputs travel (parallelize_moe(ep_overlap=False))",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also step torch.compile(moe) in every repeat, next to the eager step",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile mode (inductor only)",
    )
    p.add_argument(
        "--compile-cache",
        choices=["fresh", "default"],
        default="fresh",
        help="fresh: compile into an empty inductor cache directory (a first run's compile "
        "time); default: torch's cache directory, warm from earlier runs",
    )
    p.add_argument(
        "--nested-graph-breaks",
        action="store_true",
        help="torch._dynamo.config.nested_graph_breaks = True for the compiled layer",
    )
    args = p.parse_args()
    if args.nested_graph_breaks and not args.compile:
        p.error("--nested-graph-breaks needs --compile")
    if args.compile_mode != "default" and args.compile_backend != "inductor":
        p.error("--compile-mode needs --compile-backend inductor")
    if args.capacity_factor is not None and args.capacity_per_expert is not None:
        p.error("--capacity-factor and --capacity-per-expert: give one")
    if args.pad_to_capacity and args.capacity_factor is None and args.capacity_per_expert is None:
        p.error("--pad-to-capacity needs --capacity-factor or --capacity-per-expert")
    if args.device != "cpu" and args.layout in PARALLEL:
        p.error(f"--device {args.device} needs --layout single (the parallel layouts run gloo "
                "processes on CPU)")
    if args.device != "cpu":
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as err:
            p.error(f"--device {args.device} is not available here: {err}")
    if args.profile < 0 or args.profile_rows < 1:
        p.error("--profile needs N >= 0 and --profile-rows >= 1")
    if args.free_exchanges and args.layout not in PARALLEL:
        p.error("--free-exchanges needs a parallel --layout")
    if args.preset:
        sizes = ("experts", "top_k", "hidden", "shared")
        given = [f"--{n.replace('_', '-')}" for n in sizes if getattr(args, n) != p.get_default(n)]
        if given:
            p.error(f"--preset {args.preset} sets {', '.join(given)}; leave them out")
        for name in sizes:
            setattr(args, name, PRESETS[args.preset][name])
        if args.full_size:
            if args.dim != p.get_default("dim"):
                p.error(f"--full-size sets --dim {PRESETS[args.preset]['full']['dim']}; "
                        "leave it out")
            args.dim, args.hidden = (PRESETS[args.preset]["full"][n] for n in ("dim", "hidden"))
    elif args.full_size:
        p.error("--full-size needs --preset")
    return args


def rank_context(device: str):
    """The multiprocessing context that starts a benchmark's ranks: fork on Linux on CPU, so the
    ranks start with torch and dtensor_moe already imported; spawn elsewhere, and with CUDA (a
    forked child cannot use CUDA the parent initialized). Call it before this process creates a
    process group, runs a torch op (an OpenMP team would hang a forked rank with --threads > 1)
    or compiles anything."""
    import torch.multiprocessing as mp

    return mp.get_context("fork" if sys.platform == "linux" and device == "cpu" else "spawn")


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        if args.compile and args.compile_cache == "fresh":
            # Read when inductor first needs it, here and in the parallel ranks (inherited).
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe_bench_inductor_"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        result = LAYOUTS[args.layout](args)
    print(
        (f"preset={args.preset} " if args.preset else "")
        + f"layout={args.layout} tokens={args.tokens} dim={args.dim} hidden={args.hidden} "
        f"experts={args.experts} top_k={args.top_k} shared={args.shared} dtype={args.dtype} "
        f"threads={args.threads} repeats={args.repeats}"
        + (f" device={args.device} ({torch.cuda.get_device_name()}, torch {torch.__version__})"
           if args.device == "cuda" else f" device={args.device}" if args.device != "cpu" else "")
        + (" free_exchanges (diagnostic: outputs are wrong)" if args.free_exchanges else "")
        + (" no_overlap (plain EP path)" if args.no_overlap else "")
        + (" plain_routed_step" if args.plain_routed_step else "")
        + (f" capacity_factor={args.capacity_factor}" if args.capacity_factor else "")
        + (f" capacity_per_expert={args.capacity_per_expert}" if args.capacity_per_expert else "")
        + (" pad_to_capacity" if args.pad_to_capacity else "")
        + (" routing=forced_balanced (debug: outputs are not the model's)" if args.balanced
           else "")
    )
    rows = "rows per rank" if args.layout in PARALLEL else "rows per expert"
    print(f"expert path: {result['path']}  {rows}: {result['counts']}")
    print(f"step  (layer fwd+bwd, median): {result['step_ms']:8.2f} ms")
    print(f"floor (experts fwd+bwd, median): {result['floor_ms']:6.2f} ms")
    print(f"overhead (step - floor): {result['step_ms'] - result['floor_ms']:6.2f} ms")
    print(f"step / floor (median of per-repeat ratios): {result['ratio']:.3f}")
    if "cpu_ratio" in result:
        print(
            f"process CPU per rank (all threads, mean over ranks, median): step "
            f"{result['cpu_step_ms']:.2f} ms, floor {result['cpu_floor_ms']:.2f} ms, "
            f"step / floor {result['cpu_ratio']:.3f}"
        )
        if result["exchanges"]:
            print(
                f"the step's {result['exchanges']} all-to-alls replayed alone: wall "
                f"{result['exchanges_ms']:.2f} ms, process CPU {result['cpu_exchanges_ms']:.2f} "
                f"ms per rank = {result['cpu_exchanges_share']:.3f} of the floor's"
            )
        else:
            print("no expert-parallel exchange in this layout: nothing replayed")
    if args.compile:
        _print_compiled(args, result)


def _print_compiled(args: argparse.Namespace, result: dict[str, object]) -> None:
    where = " (slowest rank)" if args.layout in PARALLEL else ""
    print(
        f"torch.compile(moe): backend={args.compile_backend} mode={args.compile_mode} "
        f"cache={args.compile_cache}"
        + (" nested_graph_breaks" if args.nested_graph_breaks else "")
    )
    print(f"eager step    (fwd+bwd, median){where}: {result['step_ms']:8.2f} ms")
    print(f"compiled step (fwd+bwd, median){where}: {result['compiled_ms']:8.2f} ms")
    print(f"compiled / eager (median of per-repeat ratios): {result['compiled_ratio']:.3f}")
    print(f"compiled / floor (median of per-repeat ratios): {result['compiled_floor_ratio']:.3f}")
    if "cpu_compiled_ratio" in result:
        print(
            f"process CPU per rank (median): eager {result['cpu_step_ms']:.2f} ms, compiled "
            f"{result['cpu_compiled_ms']:.2f} ms, compiled / eager "
            f"{result['cpu_compiled_ratio']:.3f}"
        )
    print(f"first compiled step (compile + run){where}: {result['compile_s']:.2f} s")
    print(
        f"dynamo{' (most on any rank)' if where else ''}: {result['graphs']} graphs, "
        f"{result['graph_breaks']} graph breaks, recompiles during the timed repeats: "
        f"{result['recompiles']}"
    )


if __name__ == "__main__":
    main()
