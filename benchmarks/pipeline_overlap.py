"""``ScheduleDualPipeV`` step time with and without ``overlap_f_b``, side by side.

Shape legend: b sequences per micro-batch and pipeline, L tokens per sequence, D dim.

4 gloo processes: two pipeline stages of two ranks (``build_moe_meshes(pp=2, dp=2, ep=2)``),
4 V-placed stages of ``--layers`` MoE blocks each (``h + MoE(RMSNorm(h))``), EP2 inside every
stage, ``--microbatches`` micro-batches of ``b * L`` tokens per pipeline. The same stages run
under two schedules built on them: the plain ``ScheduleDualPipeV`` and the same schedule with
``overlap_f_b`` (Note [F/B overlap] in ``dtensor_moe/parallel/overlap.py``), which runs the
forward and the backward of each ``OVERLAP_F_B`` pair taking turns at every expert-parallel
exchange.

Every repeat times one step of each, in alternating order (plain first in even repeats). A
step's time is the slowest rank's (``all_reduce`` MAX of the per-rank wall times between a
barrier and the step's end). It prints the median of each and the median of the per-repeat
``overlapped / plain`` ratios (below 1: the overlap is faster), and, before timing, the
largest difference between the two schedules' gradients after one step each (the same model
and data: rounding only). It also prints the process CPU time of a step (every thread, gloo's
included), per rank: what the overlap costs in work, which the wall time hides when the cores
are idle and shows when they are all busy.

Run::

    python benchmarks/pipeline_overlap.py          # D 256, H 256, 32 experts top-2, 2048 tokens
    python benchmarks/pipeline_overlap.py --tokens 4096 --microbatches 8 --repeats 9

On CPU every rank is a process with ``--threads`` intra-op threads, and gloo's all-to-all
progresses on its own threads; with more ranks than cores the figures are noisy.
"""

# ruff: noqa: N806

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from dtensor_moe import MoE, MoEConfig, build_moe_meshes, parallelize_moe
from dtensor_moe.parallel import overlap_f_b

WORLD = 4


class Block(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.dim)
        self.moe = MoE(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class Stage(nn.Module):
    """Some blocks of the model, keyed by their index in it (as torchtitan splits a model)."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h)
        return h


def _stages(args: argparse.Namespace, meshes) -> list:
    from torch.distributed.pipelining import PipelineStage

    config = MoEConfig(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts,
                       top_k=args.top_k, aux_loss_mode="attach")  # fmt: skip
    torch.manual_seed(0)
    num_stages = 2 * meshes.pp
    blocks = [Block(config) for _ in range(num_stages * args.layers)]
    b, L = args.batch, args.tokens // args.batch
    hidden = torch.empty(b, L, args.dim, device="meta", requires_grad=True)
    stages = []
    for index in (meshes.pp_rank, num_stages - 1 - meshes.pp_rank):  # the V placement
        first = index * args.layers
        module = Stage({str(i): copy.deepcopy(blocks[i])
                        for i in range(first, first + args.layers)})  # fmt: skip
        parallelize_moe(module, meshes, sequence_parallel=False)
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu"),
                                    input_args=hidden, output_args=hidden,
                                    group=meshes.pp_mesh.get_group()))  # fmt: skip
    return stages


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y * target).sum() / y.numel()


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    from torch.distributed.pipelining import ScheduleDualPipeV

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    meshes = build_moe_meshes(pp=2, dp=2, ep=2)
    stages = _stages(args, meshes)
    modules = [s.submod for s in stages]
    schedules = {
        "plain": ScheduleDualPipeV(stages, args.microbatches, loss_fn=_loss),
        "overlapped": overlap_f_b(ScheduleDualPipeV(stages, args.microbatches, loss_fn=_loss)),
    }
    gen = torch.Generator().manual_seed(1 + meshes.dense.get_local_rank("dp"))
    rows = args.microbatches * args.batch
    x = torch.randn(rows, args.tokens // args.batch, args.dim, generator=gen)
    target = torch.randn(x.shape, generator=gen)

    cpu: dict[str, list[float]] = {name: [] for name in schedules}

    def step(name: str) -> float:
        for m in modules:
            m.zero_grad(set_to_none=True)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        # rank pp_rank 0 holds stage 0 (input) and stage 3 (loss): the V placement
        kwargs = dict(target=target) if meshes.pp_rank == 0 else {}
        schedules[name].step(*([x] if meshes.pp_rank == 0 else []), **kwargs)
        took = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu],
                            dtype=torch.float64)  # fmt: skip
        dist.all_reduce(took[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(took[1:], op=dist.ReduceOp.SUM)
        cpu[name].append(float(took[1]) / WORLD)
        return float(took[0])

    grads = {}
    for name in schedules:  # also the warmup
        step(name)
        grads[name] = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad.clone()
                       for m in modules for p in m.parameters()]  # fmt: skip
    diff = max(float((a - b).abs().max()) for a, b in zip(*grads.values()))
    diff_t = torch.tensor(diff, dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    for _ in range(args.warmup - 1):
        for name in schedules:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in schedules}
    ratios = []
    for r in range(args.repeats):
        order = ["plain", "overlapped"] if r % 2 == 0 else ["overlapped", "plain"]
        got = {name: step(name) for name in order}
        for name, t in got.items():
            times[name].append(t)
        ratios.append(got["overlapped"] / got["plain"])
    if rank == 0:
        cpu_ratios = [o / p for o, p in zip(cpu["overlapped"][-args.repeats:],
                                             cpu["plain"][-args.repeats:])]  # fmt: skip
        queue.put(dict(times=times, ratios=ratios, grad_diff=float(diff_t),
                       cpu={n: statistics.median(c[-args.repeats:]) for n, c in cpu.items()},
                       cpu_ratio=statistics.median(cpu_ratios)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048,
                   help="tokens per micro-batch and pipeline (b * L)")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch (b)")
    p.add_argument("--layers", type=int, default=1, help="MoE blocks per stage (4 stages)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.tokens % args.batch:
        p.error(f"--tokens {args.tokens} must be a multiple of --batch {args.batch}")
    if args.microbatches < 4:
        p.error(f"--microbatches {args.microbatches}: ScheduleDualPipeV needs at least 4 "
                "(the number of stages)")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first step of each compares the gradients)")

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # fork on Linux (CPU only here): the ranks start with torch and dtensor_moe already imported.
    # This process has no process group and has run no torch op (an OpenMP team used here would
    # hang a forked rank with --threads > 1). Spawn elsewhere.
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        result = queue.get(timeout=1800)
    finally:
        for proc in procs:
            proc.join()
    plain, over = (statistics.median(result["times"][n]) for n in ("plain", "overlapped"))
    print(f"ScheduleDualPipeV, pp2 x ep2 on {WORLD} gloo ranks x {args.threads} thread(s): "
          f"D {args.dim}, H {args.hidden}, {args.experts} experts top-{args.top_k}, "
          f"{args.tokens} tokens per micro-batch and pipeline, {args.microbatches} "
          f"micro-batches, {args.layers} MoE block(s) per stage")
    print(f"largest grad difference, overlapped vs plain (one step each): "
          f"{result['grad_diff']:.2e}")
    print(f"step (median of {args.repeats}): plain {plain * 1e3:.1f} ms, overlapped "
          f"{over * 1e3:.1f} ms")
    print(f"overlapped / plain (median of per-repeat ratios): "
          f"{statistics.median(result['ratios']):.3f}")
    cpu = result["cpu"]
    print(f"process CPU time per rank (all threads, mean over ranks, median): plain "
          f"{cpu['plain'] * 1e3:.1f} ms, overlapped {cpu['overlapped'] * 1e3:.1f} ms, "
          f"ratio {result['cpu_ratio']:.3f}")


if __name__ == "__main__":
    main()
