"""What a Muon step costs across meshes, against one process stepping the full params.

Run:  python benchmarks/muon_step.py [--dim 256] [--layers 4] [--steps 10] [--repeats 3]

Launches 4 gloo processes (1 intra-op thread each) and trains the demo's MoE transformer
(``dtensor_moe.demo``) with the recipe of docs/optimizers.md (Muon for hidden matrices and
routed experts, fused AdamW for the rest) under two layouts:

- ``fsdp-ep``: ``build_moe_meshes(dp=4, ep=2)``: FSDP2 over 4 ranks for the dense params, the
  experts split over ep2 and FSDP2 over edp2 (experts whole per rank when they split evenly);
- ``tp``: ``build_moe_meshes(dp=2, tp=2, ep=2)``, the demo's default: dp2 x tp2 with sequence
  parallelism, EP borrowing the tp ranks, FSDP2 on dp.

Per step, every rank times (wall clock, after a barrier) its whole training step and its Muon
step; the script takes the max over ranks of each, then the median over steps, and prints each
rank's own median Muon step too, on the wall clock and in the thread's CPU time (four processes
share the cores, so the CPU time shows how the work splits between ranks). It also counts
the bytes each rank sends in the Muon step's all-to-alls (counted around
``torch.distributed.all_to_all_single`` for one step): the largest per rank, and the sum over
ranks divided by the bytes of all Muon params in ``--ns-dtype``. The baseline is one process
(rank 0, the others waiting) stepping Muon over the full params with the same grads, gathered:
what the step would cost without sharding, with no communication. Every figure is printed per
layout with its median over ``--repeats`` runs of the whole measurement.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import dtensor_moe
from dtensor_moe.demo.layout import apply_layout
from dtensor_moe.demo.model import ModelConfig, MoETransformer
from dtensor_moe.moe import MoEConfig
from dtensor_moe.optim import Muon, muon_param_groups

WORLD = 4
LAYOUTS = {"fsdp-ep": dict(dp=4, ep=2, tp=1), "tp": dict(dp=2, ep=2, tp=2)}
LR = 3e-3


def _model(args) -> MoETransformer:
    torch.manual_seed(0)
    moe = MoEConfig(dim=args.dim, hidden_dim=2 * args.dim, num_experts=args.experts, top_k=2)
    return MoETransformer(ModelConfig(vocab_size=64, dim=args.dim, n_layers=args.layers,
                                      n_heads=4, moe=moe))


def _tokens(step: int, args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (8, args.seq_len + 1), generator=gen)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class _CountBytes:
    """Bytes this rank sends through ``all_to_all_single`` while active."""

    def __init__(self) -> None:
        self.sent = 0
        self._real = dist.all_to_all_single

    def __enter__(self) -> _CountBytes:
        def counting(output, input, *a, **kw):
            self.sent += input.numel() * input.element_size()
            return self._real(output, input, *a, **kw)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._real


def _train_step(model, tokens, dp_rank, dp) -> None:
    rows = tokens[dp_rank * (8 // dp):(dp_rank + 1) * (8 // dp)]
    logits = model(rows[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
    dtensor_moe.clip_grad_norm_(model.parameters(), 1.0)


def _one_layout(name: str, args) -> dict:
    degrees = LAYOUTS[name]
    meshes = dtensor_moe.build_moe_meshes(**degrees)
    model = _model(args)
    apply_layout(model, meshes, sequence_parallel=True)
    groups = muon_param_groups(model)
    muon = Muon(groups.muon, lr=LR, adjust_lr_fn="match_rms_adamw", ns_dtype=args.ns_dtype)
    adamw = torch.optim.AdamW(groups.adamw, lr=LR, fused=True)
    dp_rank = dist.get_rank() // degrees["tp"]
    steps, muons, mine, cpu = [], [], [], []
    for s in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        _train_step(model, _tokens(s, args), dp_rank, degrees["dp"])
        before, cpu_before = time.perf_counter(), time.thread_time()
        muon.step()
        after, cpu_after = time.perf_counter(), time.thread_time()
        adamw.step()
        end = time.perf_counter()
        if s >= args.warmup:
            steps.append(_max_over_ranks(end - start))
            muons.append(_max_over_ranks(after - before))
            mine.append(after - before)
            cpu.append(cpu_after - cpu_before)
        if s < args.warmup + args.steps - 1:
            muon.zero_grad()
            adamw.zero_grad()
    with _CountBytes() as counted:
        muon.step()
    sent = torch.tensor([counted.sent], dtype=torch.float64)
    dist.all_reduce(sent)
    full_grads = [g.full_tensor() if isinstance(g, DTensor) else g
                  for g in (p.grad for p in groups.muon)]
    full_params = [p.full_tensor() if isinstance(p, DTensor) else p.detach()
                   for p in groups.muon]
    single = (
        _single_process(full_params, full_grads, args) if dist.get_rank() == 0 else (0.0, 0.0)
    )
    per_rank = [None] * WORLD
    dist.all_gather_object(per_rank, (statistics.median(mine), statistics.median(cpu)))
    ns_bytes = sum(p.numel() * args.ns_dtype.itemsize for p in full_params)
    return {
        "step": statistics.median(steps),
        "muon": statistics.median(muons),
        "per_rank": per_rank,
        "single": single[0],
        "single_cpu": single[1],
        "sent_max": _max_over_ranks(counted.sent),
        "sent_total": float(sent),
        "ns_bytes": ns_bytes,
    }


def _single_process(full_params, full_grads, args) -> float:
    """Median Muon step over the full params as plain tensors in this process."""
    params = [p.detach().clone().requires_grad_() for p in full_params]
    for p, g in zip(params, full_grads, strict=True):
        p.grad = g.clone()
    opt = Muon(params, lr=LR, adjust_lr_fn="match_rms_adamw", ns_dtype=args.ns_dtype)
    times, cpu = [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.thread_time()
        opt.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - cpu_start)
    return statistics.median(times), statistics.median(cpu)


def _worker(rank: int, port: int, args) -> None:
    torch.set_num_threads(1)
    # gathering the full params for the baseline: torch logs a suboptimal-redistribute warning
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the demo model's output
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        runs = {name: [_one_layout(name, args) for _ in range(args.repeats)] for name in LAYOUTS}
        if rank == 0:
            _report(runs, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _report(runs: dict, args) -> None:
    print(f"Muon step, demo model dim {args.dim}, {args.layers} layers, {args.experts} experts, "
          f"Newton-Schulz in {args.ns_dtype}; {WORLD} gloo ranks, medians of {args.repeats} "
          f"runs of {args.steps} steps")
    print(f"{'layout':<9} {'muon ms (max rank)':>19} {'one process ms':>15} {'ratio':>6} "
          f"{'share of step':>14} {'sent/rank KiB (max)':>20} {'sent all / params':>18}  "
          "muon ms per rank (wall / CPU); one process CPU ms")
    for name, rs in runs.items():
        muon, single, step = (_median(rs, k) for k in ("muon", "single", "step"))
        sent_max, total, ns = (_median(rs, k) for k in ("sent_max", "sent_total", "ns_bytes"))
        ranks = [
            tuple(statistics.median(r["per_rank"][i][k] for r in rs) * 1e3 for k in (0, 1))
            for i in range(WORLD)
        ]
        print(f"{name:<9} {muon * 1e3:>19.2f} {single * 1e3:>15.2f} {muon / single:>6.2f} "
              f"{muon / step:>14.3f} {sent_max / 1024:>20.1f} {total / ns:>18.2f}  "
              + " ".join(f"{w:.1f}/{c:.1f}" for w, c in ranks)
              + f"; {_median(rs, 'single_cpu') * 1e3:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ns-dtype", choices=("bfloat16", "float32"), default="float32",
                        help="Muon's ns_dtype (torch's Muon: bfloat16, many times slower on CPU)")
    args = parser.parse_args()
    args.ns_dtype = getattr(torch, args.ns_dtype)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork on Linux (CPU only here): the ranks start with torch and dtensor_moe already imported
    # (this process has no process group). Spawn elsewhere.
    mp.start_processes(_worker, args=(port, args), nprocs=WORLD,
                       start_method="fork" if sys.platform == "linux" else "spawn")


if __name__ == "__main__":
    main()
