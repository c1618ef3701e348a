"""Fused AdamW step time over DTensor params on two meshes vs the same local shards as tensors.

Run:  python benchmarks/optimizer_step.py [--repeats 5] [--steps 50]

Launches 4 gloo processes with 1 intra-op thread each. Half the params are ``Shard(0)`` on a
1-D world mesh, half ``[Shard(0), Shard(1)]`` on a 2-D (2, 2) mesh. The plain-tensor baseline
steps a second fused AdamW over clones of exactly the local shards each rank holds, so both
optimizers run the same kernel on the same number of elements. The two are timed step by step,
interleaved, in the same processes; each repeat takes the median step time of each side, and
rank 0 prints the medians over repeats and the median ratio. Times are per-thread CPU time (each
rank runs one thread and the step communicates nothing), so oversubscribed cores do not distort
them. The first step (which
creates the optimizer state) is reported separately.

``--device cuda`` runs one process on one GPU instead: a one-rank NCCL group, the same two meshes
with one rank each (a ``(1, 1)`` mesh and a 1-D mesh), the same params as a whole, and torch's
fused CUDA kernel on both sides. Each step is timed on the wall clock with the device queue
drained before and after it, so the times are of the launch work and the kernels together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

# --torch-only (for reference) runs the same benchmark without importing dtensor_moe; spawned
# workers re-import this module, so the choice travels in the environment.
TORCH_ONLY = os.environ.get("DTENSOR_MOE_BENCH_TORCH_ONLY") == "1"
if not TORCH_ONLY:
    import dtensor_moe  # noqa: F401  (registers the fused-optimizer handlers)
    from dtensor_moe._compat import subclass_torch_function_disabled
    from dtensor_moe.optim.fast_step import fast_step_applies

WORLD = 4
CASES = {"200 x 64x64": (200, 64), "8 x 1024x1024": (8, 1024)}
DEVICE_CASES = {**CASES, "96 x 2048x2048": (96, 2048)}  # --device: + a 400M-param model
DEVICE = "cpu"  # --device sets it; the CPU benchmark's spawned workers keep "cpu"


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


def _time_init_group(opt) -> float:
    """CPU time of torch.optim's own per-param bookkeeping (``_init_group``), no kernel.

    Run as inside ``step()``: without grad, and with Note [Fast step]'s context where it applies.
    """
    group = opt.param_groups[0]
    lists: list[list] = [[] for _ in range(6)]
    fast = not TORCH_ONLY and fast_step_applies(opt)
    with torch.no_grad(), subclass_torch_function_disabled() if fast else contextlib.nullcontext():
        start = time.thread_time()
        opt._init_group(group, *lists)
        return time.thread_time() - start


def _timed_turns(opt_dt, opt_plain, steps: int, concurrency: int):
    """Per-step times of both optimizers, ``concurrency`` ranks stepping at a time.

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
                    t_plain.append(_time_step(opt_plain))
                    t_dt.append(_time_step(opt_dt))
                else:
                    t_dt.append(_time_step(opt_dt))
                    t_plain.append(_time_step(opt_plain))
    dist.barrier()
    return t_dt, t_plain


def _bench_case(num: int, size: int, steps: int, repeats: int, concurrency: int) -> dict:
    dt_params, plain_params = _make_params(num, size)
    _set_grads(dt_params)
    _set_grads(plain_params)
    opt_dt = torch.optim.AdamW(dt_params, lr=1e-3, fused=True)
    opt_plain = torch.optim.AdamW(plain_params, lr=1e-3, fused=True)
    first_dt, first_plain = _time_step(opt_dt), _time_step(opt_plain)
    ratios, dt_times, plain_times, book_dt, book_plain = [], [], [], [], []
    for _ in range(repeats):
        t_dt, t_plain = _timed_turns(opt_dt, opt_plain, steps, concurrency)
        book_dt.append(statistics.median(_time_init_group(opt_dt) for _ in range(steps)))
        book_plain.append(statistics.median(_time_init_group(opt_plain) for _ in range(steps)))
        dt_times.append(statistics.median(t_dt))
        plain_times.append(statistics.median(t_plain))
        ratios.append(dt_times[-1] / plain_times[-1])
    return {
        "dtensor_ms": statistics.median(dt_times) * 1e3,
        "plain_ms": statistics.median(plain_times) * 1e3,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "bookkeeping_extra_ms": (statistics.median(book_dt) - statistics.median(book_plain)) * 1e3,
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
                if rank == 0:
                    print(
                        f"{label:>14}, {concurrency} of {world} ranks stepping at once: DTensor "
                        f"{res['dtensor_ms']:.3f} ms | plain {res['plain_ms']:.3f} ms | ratio "
                        f"{res['ratio']:.3f} (per-repeat "
                        f"{', '.join(f'{r:.3f}' for r in res['ratios'])}) | first step DTensor "
                        f"{res['first_dtensor_ms']:.1f} ms, plain {res['first_plain_ms']:.1f} ms | "
                        f"torch.optim's per-param bookkeeping, DTensor minus plain: "
                        f"{res['bookkeeping_extra_ms']:.3f} ms",
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
        if args.torch_only:
            parser.error("--torch-only is for the CPU benchmark")
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
    if args.torch_only:
        os.environ["DTENSOR_MOE_BENCH_TORCH_ONLY"] = "1"
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
    )
    mp.spawn(_worker, args=(port, args.steps, args.repeats, modes), nprocs=WORLD)


if __name__ == "__main__":
    main()
