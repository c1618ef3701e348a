"""Muon across meshes on 4 gloo ranks, against ``torch.optim.Muon`` on the full tensors.

The reference never runs our code: it is torch's own Muon on plain full tensors, with 3-D
expert weights stepped as one 2-D param per expert.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe.optim.muon as muon_module
from dtensor_moe.optim import Muon
from tests._dist import DistTestBase

STEPS = 3
KW = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")

# (name, mesh, global shape, placements); meshes: "world" (4,), "2d" (dp=2, tp=2), "tp" its slice
LAYOUTS = [
    ("rows_uneven", "world", (7, 6), (Shard(0),)),            # FSDP2-like, 2,2,2,1 rows
    ("cols_tp", "tp", (6, 10), (Shard(1),)),                    # TP row-wise
    ("fsdp_tp", "2d", (8, 6), (Shard(0), Shard(1))),            # FSDP2 over TP row-wise
    ("strided", "2d", (8, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 over TP col
    ("replicated", "world", (5, 4), (Replicate(),)),
    ("plain", None, (4, 4), None),
    ("experts_ep", "world", (4, 6, 5), (Shard(0),)),           # EP: whole experts per rank
    ("experts_ep_etp", "2d", (4, 6, 8), (Shard(0), Shard(2))),  # EP x expert TP
    ("experts_edp", "2d", (2, 6, 8), (Shard(1), Shard(0))),     # FSDP2 on dim 1 over EP
]


def _full(step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((step, shape)) % 2**31)
    return torch.randn(shape, generator=gen)


def _reference() -> list[torch.Tensor]:
    """torch.optim.Muon on the full tensors; a 3-D weight is one 2-D param per expert."""
    params = []
    for _, _, shape, _ in LAYOUTS:
        full = _full(-1, shape)
        params.append([full] if len(shape) == 2 else list(full.unbind(0)))
    flat = [p.clone().requires_grad_() for ps in params for p in ps]
    opt = torch.optim.Muon(flat, **KW)
    for step in range(STEPS):
        grads = []
        for _, _, shape, _ in LAYOUTS:
            g = _full(step, shape)
            grads.extend([g] if len(shape) == 2 else list(g.unbind(0)))
        for p, g in zip(flat, grads, strict=True):
            p.grad = g
        opt.step()
    out, it = [], iter(flat)
    for _, _, shape, _ in LAYOUTS:
        out.append(next(it).detach() if len(shape) == 2 else torch.stack(
            [next(it).detach() for _ in range(shape[0])]))
    return out


class MuonMeshesTest(DistTestBase):
    def _meshes(self) -> dict:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return {"world": init_device_mesh("cpu", (4,)), "2d": mesh2, "tp": mesh2["tp"], None: None}

    def _params(self, meshes, step: int) -> list[torch.Tensor]:
        out = []
        for _, mesh, shape, placements in LAYOUTS:
            full = _full(step, shape)
            out.append(full if mesh is None else distribute_tensor(full, meshes[mesh], placements))
        return out

    @with_comms
    def test_every_layout_matches_torch_muon_bit_for_bit(self):
        # 3 steps over params on three meshes in one optimizer; the params, gathered, equal
        # torch.optim.Muon's on the full tensors bit for bit; momentum buffers keep their
        # param's placements; collectives counted and bytes bounded (Note [Owner assembly]).
        meshes = self._meshes()
        params = [p.requires_grad_() for p in self._params(meshes, -1)]
        opt = Muon(params, **KW)
        sent = []
        real = dist.all_to_all_single

        def counting(out, inp, out_splits, in_splits, group):
            sent.append(inp.numel() * inp.element_size())
            return real(out, inp, out_splits, in_splits, group=group)

        for step in range(STEPS):
            for p, g in zip(params, self._params(meshes, step), strict=True):
                p.grad = g
            with CommDebugMode() as comm, mock.patch.object(
                muon_module.dist, "all_to_all_single", counting
            ):
                opt.step()
            if step == 0:
                counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        # exchanges: world (0,), tp (0,), 2d (1, 0) [two params], 2d (1,), 2d (0,): 2 * (1+1+2+1+1)
        self.assertExpectedInline(str(counts), """{'c10d.alltoall_base_': 12}""")
        # bytes this rank sent over the 3 steps: its shards to the owners and the owners'
        # results back, in bfloat16; at most twice the bf16 bytes of its sharded locals per step
        local_bf16 = sum(
            p.to_local().numel() * 2 for p, (_, m, _, pl) in zip(params, LAYOUTS)
            if m is not None and any(x.is_shard() or isinstance(x, _StridedShard) for x in pl)
        )
        self.assertLessEqual(sum(sent), STEPS * 2 * 2 * local_bf16)
        ref = _reference()
        for (name, mesh, _, placements), p, r in zip(LAYOUTS, params, ref, strict=True):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            self.assertTrue(torch.equal(full.detach(), r), name)
            buf = opt.state[p]["momentum_buffer"]
            if mesh is not None:
                self.assertEqual(buf.placements, placements, name)
                self.assertEqual(buf.device_mesh, meshes[mesh], name)
