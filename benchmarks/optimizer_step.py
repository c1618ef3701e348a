"""Fused AdamW step time over DTensor params on two meshes vs the same local shards as tensors.

Run:  python benchmarks/optimizer_step.py [--repeats 5] [--steps 50]

Launches 4 gloo processes with 1 intra-op thread each. Half the params are ``Shard(0)`` on a
1-D world mesh, half ``[Shard(0), Shard(1)]`` on a 2-D (2, 2) mesh. The plain-tensor baseline
steps a second fused AdamW over clones of exactly the local shards each rank holds, so both
optimizers run the same kernel on the same number of elements. The two are timed step by step,
interleaved, in the same processes; each repeat takes the median step time of each side, each
rank takes the medians over repeats and the median ratio, and rank 0 prints those of the rank
with the largest ratio (and every rank's ratio). Times are per-thread CPU time (each
rank runs one thread and the step communicates nothing), so oversubscribed cores do not distort
them. The first step (which creates the optimizer state) is reported separately.

Where the difference goes: after the timed steps of each repeat, as many steps again run with
timers around ``torch._fused_adamw_`` (the call torch.optim makes) and around dtensor_moe's
DTensor handler (benchmark-only wrappers, put back at once; the timed steps run without them).
The script prints, per step and as medians, what the DTensor step spends more than the plain one
outside that call (torch.optim's own Python over DTensor objects), inside DTensor's dispatch
before the handler starts (C++ boxing of the tensor lists), and inside the handler besides the
kernel (the plain step's call of the same kernel on the same local shapes stands in for it).

``--device cuda`` runs one process on one GPU instead: a one-rank NCCL group, the same two meshes
with one rank each (a ``(1, 1)`` mesh and a 1-D mesh), the same params as a whole, and torch's
fused CUDA kernel on both sides. Each step is timed on the wall clock with the device queue
drained before and after it, so the times are of the launch work and the kernels together.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

# --torch-only (for reference) runs the same benchmark without importing dtensor_moe, and
# --unchecked-handler (a diagnostic) with a handler that only unwraps; the workers of those runs
# are spawned and re-import this module, so the choice travels in the environment.
TORCH_ONLY = os.environ.get("DTENSOR_MOE_BENCH_TORCH_ONLY") == "1"
UNCHECKED = os.environ.get("DTENSOR_MOE_BENCH_UNCHECKED") == "1"
if not TORCH_ONLY:
    import dtensor_moe  # noqa: F401  (registers the fused-optimizer handlers)
    from dtensor_moe._compat import custom_op_handlers


def _unchecked_handler(op, args, kwargs):
    """--unchecked-handler: the kernel on the local tensors, nothing checked. The least that
    any handler reached through DTensor's dispatch can cost; wrong for misaligned slots."""
    return _UNCHECKED_KERNEL(
        *[[t._local_tensor if type(t) is DTensor else t for t in a] for a in args], **kwargs
    )


_UNCHECKED_KERNEL = torch._fused_adamw_
if UNCHECKED and not TORCH_ONLY:
    custom_op_handlers()[torch.ops.aten._fused_adamw_.default] = _unchecked_handler

WORLD = 4
CASES = {"200 x 64x64": (200, 64), "8 x 1024x1024": (8, 1024)}
DEVICE_CASES = {**CASES, "96 x 2048x2048": (96, 2048)}  # --device: + a 400M-param model
DEVICE = "cpu"  # --device sets it; the CPU benchmark's workers keep "cpu"


def _make_params(num: int, size: int):
    n = dist.get_world_size()
    mesh2d = init_device_mesh(DEVICE, (2, n // 2) if n > 1 else (1, 1), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh(DEVICE, (n,), mesh_dim_names=("world",))
    gen = torch.Generator().manual_seed(0)
    dt_params = []
    for i in range(num):
        full = torch.randn(size, size, generator=gen).to(DEVICE)
        if i % 2 == 0:
            dt_params.append(distribute_tensor(full, world, [Shard(0)]))
        else:
            dt_params.append(distribute_tensor(full, mesh2d, [Shard(0), Shard(1)]))
    plain = [p.to_local().clone() for p in dt_params]
    return [p.requires_grad_() for p in dt_params], [p.requires_grad_() for p in plain]


def _set_grads(params) -> None:
    for p in params:
        p.grad = torch.ones_like(p) * 1e-3


def _time_step(opt) -> float:
    """CPU time of one step on this (single-threaded) rank.

    Four processes share the cores of a small machine, so wall time mostly measures who was
    scheduled; the step runs on one thread with no communication, so thread CPU time is its cost.
    """
    if DEVICE != "cpu":  # wall clock around the step, the device queue drained on both sides
        torch.accelerator.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.accelerator.synchronize()
        return time.perf_counter() - start
    start = time.thread_time()
    opt.step()
    return time.thread_time() - start


class _Timers:
    """Benchmark-only timers: thread CPU time inside ``torch._fused_adamw_`` (what torch.optim
    calls) and inside the DTensor handler of ``aten._fused_adamw_``; see the module docstring.

    Installed for a block of steps and removed after it, so the timed steps run untouched.
    """

    def __init__(self) -> None:
        self.call: list[float] = []
        self.handler: list[float] = []

    @staticmethod
    def _timed(fn, into: list):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append(time.thread_time() - start)

        return timed

    def __enter__(self) -> _Timers:
        self._fn = torch._fused_adamw_
        torch._fused_adamw_ = self._timed(self._fn, self.call)
        self._ops = {}
        if not TORCH_ONLY:
            handlers = custom_op_handlers()
            packet = torch.ops.aten._fused_adamw_
            for op in (packet.default, packet.tensor_lr):
                self._ops[op] = handlers[op]
                handlers[op] = self._timed(handlers[op], self.handler)
        return self

    def __exit__(self, *exc) -> None:
        torch._fused_adamw_ = self._fn
        handlers = custom_op_handlers() if self._ops else {}
        for op, handler in self._ops.items():
            handlers[op] = handler


def _timed_breakdown(opt) -> tuple[float, float, float]:
    """(step, torch._fused_adamw_ call, handler) thread CPU time of one step."""
    with _Timers() as timers:
        step = _time_step(opt)
    return step, sum(timers.call), sum(timers.handler)


def _timed_turns(opt_dt, opt_plain, steps: int, concurrency: int, time_fn=_time_step):
    """Per-step ``time_fn`` results of both optimizers, ``concurrency`` ranks stepping at a time.

    Ranks ``[k * concurrency, (k + 1) * concurrency)`` take turn ``k``; the others wait in a
    barrier (gloo waits without spinning), so with ``concurrency`` equal to the number of cores
    each timed step has a core to itself, as each rank does on a real cluster.
    """
    rank = dist.get_rank()
    t_dt, t_plain = [], []
    for turn in range(0, dist.get_world_size(), concurrency):
        dist.barrier()
        if turn <= rank < turn + concurrency:
            for i in range(steps):  # interleaved, alternating which goes first
                if i % 2:
                    t_plain.append(time_fn(opt_plain))
                    t_dt.append(time_fn(opt_dt))
                else:
                    t_dt.append(time_fn(opt_dt))
                    t_plain.append(time_fn(opt_plain))
    dist.barrier()
    return t_dt, t_plain


def _bench_case(num: int, size: int, steps: int, repeats: int, concurrency: int) -> dict:
    dt_params, plain_params = _make_params(num, size)
    _set_grads(dt_params)
    _set_grads(plain_params)
    opt_dt = torch.optim.AdamW(dt_params, lr=1e-3, fused=True)
    opt_plain = torch.optim.AdamW(plain_params, lr=1e-3, fused=True)
    first_dt, first_plain = _time_step(opt_dt), _time_step(opt_plain)
    ratios, dt_times, plain_times, parts = [], [], [], []
    for _ in range(repeats):
        t_dt, t_plain = _timed_turns(opt_dt, opt_plain, steps, concurrency)
        dt_times.append(statistics.median(t_dt))
        plain_times.append(statistics.median(t_plain))
        ratios.append(dt_times[-1] / plain_times[-1])
        if DEVICE != "cpu":  # the breakdown is thread CPU time: the CPU benchmark's alone
            continue
        b_dt, b_plain = _timed_turns(opt_dt, opt_plain, steps, concurrency, _timed_breakdown)
        if b_dt:  # this rank stepped: (outside the call, dispatch, handler without the kernel)
            kernel = statistics.median(c for _, c, _ in b_plain)
            outside_plain = statistics.median(s - c for s, c, _ in b_plain)
            parts.append((
                statistics.median(s - c for s, c, _ in b_dt) - outside_plain,
                statistics.median(c - h for _, c, h in b_dt) if not TORCH_ONLY else float("nan"),
                statistics.median(h for _, _, h in b_dt) - kernel if not TORCH_ONLY
                else float("nan"),
                kernel,
            ))
    return {
        "dtensor_ms": statistics.median(dt_times) * 1e3,
        "plain_ms": statistics.median(plain_times) * 1e3,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "parts_ms": [statistics.median(p[i] for p in parts) * 1e3 for i in range(4)]
        if parts else None,
        "first_dtensor_ms": first_dt * 1e3,
        "first_plain_ms": first_plain * 1e3,
    }


def _worker(rank: int, port: int, steps: int, repeats: int, modes: list[int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if DEVICE == "cpu":
        torch.set_num_threads(1)
    world = WORLD if DEVICE == "cpu" else 1
    dist.init_process_group("gloo" if DEVICE == "cpu" else None, rank=rank, world_size=world)
    try:
        for label, (num, size) in (CASES if DEVICE == "cpu" else DEVICE_CASES).items():
            for concurrency in modes:
                case_steps = steps if size < 512 else max(10, steps // 4)
                res = _bench_case(num, size, case_steps, repeats, concurrency)
                every = [res] if world == 1 else [None] * world
                if world > 1:
                    dist.all_gather_object(every, res)
                if rank == 0:
                    worst = max(range(world), key=lambda r: every[r]["ratio"])
                    res = every[worst]
                    ranks = ", ".join(f"{e['ratio']:.3f}" for e in every)
                    print(
                        f"{label:>14}, {concurrency} of {world} ranks stepping at once, worst "
                        f"rank ({worst}): DTensor {res['dtensor_ms']:.3f} ms | plain "
                        f"{res['plain_ms']:.3f} ms | ratio {res['ratio']:.3f} (per repeat "
                        f"{', '.join(f'{r:.3f}' for r in res['ratios'])}; every rank "
                        f"{ranks}) | first step DTensor "
                        f"{res['first_dtensor_ms']:.1f} ms, plain {res['first_plain_ms']:.1f} ms",
                        flush=True,
                    )
                    if res["parts_ms"] is None:
                        continue
                    outside, dispatch, handler, kernel = res["parts_ms"]
                    print(
                        f"{'':>14}  DTensor minus plain, per step: torch.optim outside the "
                        f"kernel call {outside:+.3f} ms, DTensor dispatch into the handler "
                        f"{dispatch:.3f} ms, handler besides the kernel {handler:+.3f} ms "
                        f"(kernel {kernel:.3f} ms)",
                        flush=True,
                    )
        dist.barrier()  # every rank tears its gloo connections down together
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; medians are printed")
    parser.add_argument(
        "--concurrency", type=int, action="append",
        help="ranks stepping at once (repeatable); default: one per core, and all 4",
    )
    parser.add_argument(
        "--torch-only", action="store_true",
        help="reference: run without importing dtensor_moe (torch 2.13's own DTensor rules)",
    )
    parser.add_argument(
        "--unchecked-handler", action="store_true",
        help="diagnostic: replace dtensor_moe's handler of the fused AdamW step by one that only "
        "unwraps the local tensors and checks nothing, to measure what torch's own dispatch "
        "and torch.optim cost",
    )
    parser.add_argument(
        "--device", default="cpu",
        help="cpu (4 gloo processes), or an accelerator such as cuda (one process, one device)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error(f"--steps and --repeats must be at least 1, got {args.steps} and "
                     f"{args.repeats}")
    if args.device != "cpu":
        if ":" in args.device:
            parser.error(f"--device takes a device type, got {args.device!r}: pick the GPU "
                         "with CUDA_VISIBLE_DEVICES instead")
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as err:
            parser.error(f"--device {args.device} is not available here: {err}")
        if args.concurrency:
            parser.error("--concurrency is for the CPU benchmark's 4 processes")
        if args.torch_only or args.unchecked_handler:
            parser.error("--torch-only and --unchecked-handler are for the CPU benchmark")
        global DEVICE
        DEVICE = args.device
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(f"fused AdamW step, one process on {torch.accelerator.current_accelerator()} "
              f"({torch.cuda.get_device_name() if args.device == 'cuda' else args.device}), "
              f"torch {torch.__version__}")
        _worker(0, port, args.steps, args.repeats, [1])
        return
    if args.torch_only and args.unchecked_handler:
        parser.error("--torch-only and --unchecked-handler exclude each other")
    if args.torch_only:
        os.environ["DTENSOR_MOE_BENCH_TORCH_ONLY"] = "1"
    if args.unchecked_handler:
        os.environ["DTENSOR_MOE_BENCH_UNCHECKED"] = "1"
    cores = len(os.sched_getaffinity(0))
    modes = args.concurrency or sorted({min(WORLD, cores), WORLD})
    if any(not 1 <= c <= WORLD or WORLD % c for c in modes):
        parser.error(f"--concurrency must divide {WORLD}, got {modes}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(
        f"fused AdamW step, {WORLD} gloo processes x 1 thread, {cores} cores, "
        f"torch {torch.__version__}" + (", WITHOUT dtensor_moe" if args.torch_only else "")
        + (", UNCHECKED HANDLER (diagnostic)" if args.unchecked_handler else "")
    )
    # fork on Linux: the workers start with torch and dtensor_moe already imported (this process
    # has no process group and has run no torch op). Spawn elsewhere, and for --torch-only and
    # --unchecked-handler, whose choice the module reads at import (above).
    fork = sys.platform == "linux" and not (args.torch_only or args.unchecked_handler)
    mp.start_processes(_worker, args=(port, args.steps, args.repeats, modes), nprocs=WORLD,
                       start_method="fork" if fork else "spawn")


if __name__ == "__main__":
    main()
