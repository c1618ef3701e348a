"""Bytes one MoE training forward saves for backward, per config (per rank for parallel layouts).

How it counts: every tensor that autograd saves during one forward of the layer (in training
mode, input requiring grad) passes through ``torch.autograd.graph.saved_tensors_hooks``. Each is
keyed by its untyped storage, ``(data_ptr, nbytes)``, and a storage counts once with its full
size, however many views of it are saved (a view keeps its whole storage alive). Parameters
saved for backward (the expert and router weights) *are* counted; the script also prints the count without them (``activations only``), which is what
the layer adds on top of the memory the model holds anyway. Bytes are deterministic: this is
no timing, and one forward per config is enough.

Run::

    python benchmarks/moe_memory.py                       # one process, both configs
    python benchmarks/moe_memory.py --layout ep4          # 4 gloo processes, per rank
    python benchmarks/moe_memory.py --recompute-experts   # MoEConfig(recompute_experts=True)

Configs (``--configs``, ``E:K:H`` each): ``8:2:512`` and ``64:8:128``; 1024 tokens per rank
(``--tokens``), dim 256, fp32 (``--dtype``). Parallel layouts: every rank routes ``--tokens``
tokens of its own; the figure printed is the largest over ranks, with the smallest beside it.
"""

# ruff: noqa: N806

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor_moe.moe import MoE, MoEConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2**20


@dataclass(frozen=True)
class Saved:
    """Bytes saved for backward: all of them, and those of non-parameter storages."""

    total: int
    activations: int


def saved_bytes(fn, params) -> tuple[object, Saved]:
    """Run ``fn()`` and count the storages autograd saves for backward (see the docstring)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[tuple[int, int], bool] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "to_local"):  # a DTensor: its local tensor holds the bytes
            t = t.to_local()
        s = t.untyped_storage()
        storages[(s.data_ptr(), s.nbytes())] = s.data_ptr() in param_ptrs
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    total = sum(n for _, n in storages)
    acts = sum(n for (_, n), is_param in storages.items() if not is_param)
    return out, Saved(total, acts)


def _config(args: argparse.Namespace, E: int, K: int, H: int) -> MoEConfig:
    return MoEConfig(
        dim=args.dim, hidden_dim=H, num_experts=E, top_k=K,
        recompute_experts=args.recompute_experts,
    )


def _local_params(moe: MoE) -> list[torch.Tensor]:
    return [p.to_local() if hasattr(p, "to_local") else p for p in moe.parameters()]


def run_single(args: argparse.Namespace, E: int, K: int, H: int) -> list[Saved]:
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    moe = MoE(_config(args, E, K, H)).to(dtype)
    x = torch.randn(1, args.tokens, args.dim, dtype=dtype, requires_grad=True)
    _, saved = saved_bytes(lambda: moe(x), _local_params(moe))
    return [saved]


@dataclass(frozen=True)
class Layout:
    """``build_moe_meshes`` arguments and the ``parallelize_moe`` option of a layout."""

    meshes: dict
    sequence_parallel: bool
    world: int = 4


PARALLEL = {
    "ep4": Layout({"dp": 4, "ep": 4}, False),
    "ep2tp2": Layout({"dp": 2, "ep": 2, "tp": 2, "expert_tp": True}, True),
    "sp2ep": Layout({"dp": 2, "ep": 2, "tp": 2}, True),
}


def _worker(rank: int, args, port: int, E: int, K: int, H: int, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

    layout = PARALLEL[args.layout]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=layout.world
    )
    meshes = build_moe_meshes(**layout.meshes)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    moe = MoE(_config(args, E, K, H)).to(dtype)
    parallelize_moe(moe, meshes, sequence_parallel=layout.sequence_parallel)
    tp = meshes.tp
    torch.manual_seed(1 + rank // tp)
    x = torch.randn(1, args.tokens * tp, args.dim, dtype=dtype)
    if tp > 1:
        x = distribute_tensor(x, meshes.dense["tp"], [Shard(1)])
    x.requires_grad_()
    moe(x)  # the first forward checks that ranks route different tokens (one all-gather)
    _, saved = saved_bytes(lambda: moe(x), _local_params(moe))
    gathered = [None] * layout.world
    dist.all_gather_object(gathered, saved)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def run_parallel(args: argparse.Namespace, E: int, K: int, H: int) -> list[Saved]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # fork on Linux (CPU only here): the ranks start with torch and dtensor_moe already imported
    # (this process has no process group). Spawn elsewhere.
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args, port, E, K, H, queue))
        for r in range(PARALLEL[args.layout].world)
    ]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join()
    return result


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layout", choices=["single", *PARALLEL], default="single")
    p.add_argument("--configs", nargs="+", default=["8:2:512", "64:8:128"], help="E:K:H")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--recompute-experts", action="store_true")
    return p.parse_args()


def main() -> None:
    args = _parse()
    print(
        f"layout={args.layout} tokens={args.tokens} (per rank) dim={args.dim} "
        f"dtype={args.dtype} recompute_experts={args.recompute_experts}"
    )
    for spec in args.configs:
        E, K, H = (int(v) for v in spec.split(":"))
        run = run_single if args.layout == "single" else run_parallel
        per_rank = run(args, E, K, H)
        total = max(s.total for s in per_rank) / MIB
        acts = max(s.activations for s in per_rank) / MIB
        where = "" if len(per_rank) == 1 else " per rank (max over ranks)"
        low = ""
        if len(per_rank) > 1:
            low = (
                f" [min {min(s.total for s in per_rank) / MIB:.2f} / "
                f"{min(s.activations for s in per_rank) / MIB:.2f}]"
            )
        print(
            f"experts={E} top_k={K} hidden={H}: saved for backward{where}: {total:.2f} MiB, "
            f"activations only (parameters excluded): {acts:.2f} MiB{low}"
        )


if __name__ == "__main__":
    main()
