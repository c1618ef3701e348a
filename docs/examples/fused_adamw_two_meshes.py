"""Step one fused AdamW over DTensor params that live on two different device meshes.

Run:  python docs/examples/fused_adamw_two_meshes.py     (launches 4 CPU/gloo processes)
  or: torchrun --standalone --nproc-per-node 4 docs/examples/fused_adamw_two_meshes.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_moe  # registers the fused-optimizer handlers

WORLD = 4


def main() -> None:
    rank = dist.get_rank()
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    torch.manual_seed(0)
    full = [torch.randn(7, 4), torch.randn(6, 6), torch.randn(5)]
    params = [
        distribute_tensor(full[0], world, [Shard(0)]),  # 7 rows over 4 ranks: uneven
        distribute_tensor(full[1], mesh2d, [Shard(0), Shard(1)]),
        distribute_tensor(full[2], mesh2d["tp"], [Replicate()]),  # a sub-mesh
    ]
    params = [p.requires_grad_() for p in params]
    reference = [t.clone().requires_grad_() for t in full]
    opt = torch.optim.AdamW(params, lr=0.01, fused=True)
    opt_ref = torch.optim.AdamW(reference, lr=0.01, fused=True)
    for step in range(3):
        torch.manual_seed(step + 1)
        grads = [torch.randn_like(t) for t in full]
        for p, r, g in zip(params, reference, grads):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            r.grad = g
        opt.step()
        opt_ref.step()
    err = max((p.full_tensor() - r).abs().max().item() for p, r in zip(params, reference))
    norm = dtensor_moe.clip_grad_norm_(params, max_norm=1.0)
    if rank == 0:
        meshes = sorted({str(p.device_mesh) for p in params})
        print(f"stepped fused AdamW over {len(params)} params on {len(meshes)} meshes")
        print(f"max abs difference vs single-device AdamW after 3 steps: {err:.2e}")
        print(f"mixed-mesh grad norm (before clipping): {norm.item():.4f}")
    assert err <= 1e-6, err


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        main()
        dist.barrier()  # every rank tears its gloo connections down together
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        main()
        dist.barrier()
        dist.destroy_process_group()
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        # fork where it exists: the workers start with torch already imported
        method = "fork" if sys.platform == "linux" else "spawn"
        mp.start_processes(_worker, args=(free_port,), nprocs=WORLD, start_method=method)
