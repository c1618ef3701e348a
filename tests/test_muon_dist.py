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

import dtensor_moe
import dtensor_moe.optim.muon as muon_module
from dtensor_moe.optim import Muon, muon_param_groups
from dtensor_moe.parallel import build_moe_meshes, fully_shard_moe, parallelize_moe
from tests._dist import DistTestBase
from tests._moe_layouts import LAYOUTS as MODEL_LAYOUTS
from tests._moe_layouts import local_rows
from tests._moe_model import global_batch, lm_loss, make_model, tensor_parallel_dense

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


def _random(step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((step, shape)) % 2**31)
    return torch.randn(shape, generator=gen)


def _reference() -> list[torch.Tensor]:
    """torch.optim.Muon on the full tensors; a 3-D weight is one 2-D param per expert."""
    params = []
    for _, _, shape, _ in LAYOUTS:
        full = _random(-1, shape)
        params.append([full] if len(shape) == 2 else list(full.unbind(0)))
    flat = [p.clone().requires_grad_() for ps in params for p in ps]
    opt = torch.optim.Muon(flat, **KW)
    for step in range(STEPS):
        grads = []
        for _, _, shape, _ in LAYOUTS:
            g = _random(step, shape)
            grads.extend([g] if len(shape) == 2 else list(g.unbind(0)))
        for p, g in zip(flat, grads, strict=True):
            p.grad = g
        opt.step()
    out, it = [], iter(flat)
    for _, _, shape, _ in LAYOUTS:
        out.append(next(it).detach() if len(shape) == 2 else torch.stack(
            [next(it).detach() for _ in range(shape[0])]))
    return out

BATCH, SEQ = 4, 6


class _TorchMuonOnFull:
    """torch.optim.Muon on plain full copies of ``params`` (a 3-D weight: one param per expert),
    stepped with the full grads it is given."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        fulls = [_full(p).detach() for p in params]
        self.leaves = [
            [f.clone().requires_grad_()] if f.ndim == 2
            else [e.clone().requires_grad_() for e in f.unbind(0)]
            for f in fulls
        ]
        self.opt = torch.optim.Muon([x for xs in self.leaves for x in xs], **KW)

    def step(self, grads: list[torch.Tensor]) -> None:
        for xs, g in zip(self.leaves, grads, strict=True):
            for x, gx in zip(xs, [g] if g.ndim == 2 else g.unbind(0), strict=True):
                x.grad = gx.clone()
        self.opt.step()

    def params(self) -> list[torch.Tensor]:
        return [xs[0].detach() if len(xs) == 1 and xs[0].ndim == 2 else
                torch.stack([x.detach() for x in xs]) for xs in self.leaves]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class MuonMeshesTest(DistTestBase):
    def _meshes(self) -> dict:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return {"world": init_device_mesh("cpu", (4,)), "2d": mesh2, "tp": mesh2["tp"], None: None}

    def _params(self, meshes, step: int) -> list[torch.Tensor]:
        out = []
        for _, mesh, shape, placements in LAYOUTS:
            full = _random(step, shape)
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
        total = torch.tensor(sum(sent) // STEPS)
        dist.all_reduce(total)
        # bytes over the wire per step, all ranks: every shard that is not on its owner, there
        # and back, in bfloat16 (elements: rows_uneven 2 * 30, cols_tp 2 dp rows * 2 * 30,
        # fsdp_tp and strided 2 * (24 + 24) each, experts_ep_etp 4 experts * 2 * 24,
        # experts_edp 2 * 2 * 24: 660 elements, 1320 bytes)
        self.assertExpectedInline(str(int(total)), """1320""")
        ref = _reference()
        for (name, mesh, _, placements), p, r in zip(LAYOUTS, params, ref, strict=True):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            self.assertTrue(torch.equal(full.detach(), r), name)
            buf = opt.state[p]["momentum_buffer"]
            if mesh is not None:
                self.assertEqual(buf.placements, placements, name)
                self.assertEqual(buf.device_mesh, meshes[mesh], name)
        self._check_float32_exchange(meshes)
        self._check_errors(meshes)

    def _check_float32_exchange(self, meshes) -> None:
        """ns_dtype=float32 moves and orthogonalizes float32: the same bits as Muon on the full
        tensors in one process (whose float32 Newton-Schulz is checked in test_muon.py)."""
        params = [p.requires_grad_() for p in self._params(meshes, -1)]
        full = [_random(-1, shape).requires_grad_() for _, _, shape, _ in LAYOUTS]
        opt = Muon(params, ns_dtype=torch.float32, **KW)
        opt_full = Muon(full, ns_dtype=torch.float32, **KW)
        for p, f, g in zip(params, full, self._params(meshes, 0), strict=True):
            p.grad = g
            f.grad = _full(g)
        opt.step()
        opt_full.step()
        for (name, *_), p, f in zip(LAYOUTS, params, full, strict=True):
            self.assertTrue(torch.equal(_full(p).detach(), f.detach()), name)

    def _check_errors(self, meshes) -> None:
        """Bad params raise on every rank that holds them, before any collective (none is
        counted: a rank that went on to an exchange would hang the test instead)."""
        world = meshes["world"]
        partial = DTensor.from_local(torch.ones(4, 4), world, [Partial()])
        # 4, 2, 2, 2 rows of a (10, 4) matrix; Shard(0) gives 3, 3, 3, 1: wrong on every rank
        untiled = DTensor.from_local(torch.ones((4, 2, 2, 2)[self.rank], 4), world, [Shard(0)],
                                     run_check=False, shape=(10, 4), stride=(4, 1))
        pair = DeviceMesh("cpu", [0, 1])  # ranks 2 and 3 are outside it
        outside = distribute_tensor(torch.ones(4, 4), pair, [Shard(0)])
        cases = [
            (partial, "a Partial param has no matrix to orthogonalize"),
            (untiled, r"its local shard on rank \d has shape .* the shards do not tile"),
            (distribute_tensor(torch.ones(4), world, [Shard(0)]), "2-D matrices .* 3-D"),
            (distribute_tensor(torch.ones(2, 2, 2, 4), world, [Shard(3)]), "2-D matrices"),
        ]
        if self.rank >= 2:
            cases.append((outside, "a mesh without rank [23]: the owner assignment needs"))
        for param, message in cases:
            with CommDebugMode() as comm, self.assertRaisesRegex(ValueError, message):
                Muon([param])
            self.assertEqual(comm.get_total_counts(), 0)
        # a grad whose local shard does not tile, at step(): raised before the exchange
        p = distribute_tensor(torch.ones(10, 4), world, [Shard(0)]).requires_grad_()
        opt = Muon([p])
        p.grad = untiled
        with CommDebugMode() as comm, self.assertRaisesRegex(ValueError, "do not tile"):
            opt.step()
        self.assertEqual(comm.get_total_counts(), 0)
        p.grad = distribute_tensor(torch.ones(10, 4), meshes["2d"], [Shard(0), Replicate()])
        with CommDebugMode() as comm, self.assertRaisesRegex(
            ValueError, "but its grad has .* a grad must live on its param's mesh"
        ):
            opt.step()
        self.assertEqual(comm.get_total_counts(), 0)
        opt.param_groups[0]["lr"] = float("nan")
        p.grad = distribute_tensor(torch.ones(10, 4), world, [Shard(0)])
        with CommDebugMode() as comm, self.assertRaisesRegex(ValueError, "lr must be a finite"):
            opt.step()
        self.assertEqual(comm.get_total_counts(), 0)


def _build(name: str, seed: int = 0):
    """The tiny MoE LM under layout ``name`` of tests/_moe_layouts.py, with Muon and AdamW.

    Two routed experts per layer: with ep2 each rank keeps one, which FSDP2 cannot split over
    edp=2 by expert, so the expert weights shard on dim 1 and are assembled on owners too.
    """
    layout = MODEL_LAYOUTS[name]
    model = make_model(seed=seed, num_experts=2, top_k=1)
    meshes = build_moe_meshes(dp=layout.dp, ep=layout.ep, tp=layout.tp,
                              expert_tp=layout.expert_tp)
    if layout.tp > 1:
        tensor_parallel_dense(model, meshes.dense["tp"], sequence_parallel=False)
    if layout.tp > 1 or layout.ep > 1:
        parallelize_moe(model, meshes, sequence_parallel=False)
    fully_shard_moe(model, meshes, blocks=model.layers)
    groups = muon_param_groups(model)
    muon = Muon(groups.muon, **KW)
    adamw = torch.optim.AdamW(groups.adamw, lr=1e-3, fused=True)
    return model, groups, muon, adamw


class MuonModelTest(DistTestBase):
    def _train(self, name, model, groups, muon, adamw, ref, steps) -> dict:
        """Real steps (FSDP2 backward, clip_grad_norm_ across meshes); the reference steps the
        same clipped grads, gathered. Returns the collectives of the first Muon step."""
        counts = None
        for s in steps:
            tokens = global_batch(s, BATCH, SEQ)[local_rows(name, self.rank, BATCH)]
            lm_loss(model, tokens).backward()
            dtensor_moe.clip_grad_norm_(model.parameters(), 1.0)
            ref.step([_full(p.grad) for p in groups.muon])
            with CommDebugMode() as comm:
                muon.step()
            counts = counts or {str(k): v for k, v in comm.get_comm_counts().items()}
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
        return counts

    def _check(self, groups, ref, label) -> None:
        for name, p, r in zip(groups.muon_names, groups.muon, ref.params(), strict=True):
            self.assertTrue(torch.equal(_full(p).detach(), r), f"{label}: {name}")

    @with_comms
    def test_fsdp_ep_and_tp_layouts_match_torch_muon_and_reshard(self):
        # dp4 with edp2 x ep2 (FSDP2 + EP) for 3 steps, then DCP save, resume at dp2 x tp2
        # (TP + FSDP2, expert TP) for 2 steps: every Muon param equals torch.optim.Muon's on
        # the gathered full tensors bit for bit, the momentum buffers reshard exactly.
        import shutil
        import tempfile

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        model, groups, muon, adamw = _build("dp4_ep2")
        ref = _TorchMuonOnFull(list(groups.muon))
        counts = self._train("dp4_ep2", model, groups, muon, adamw, ref, range(3))
        # dense matrices on dp (1 gather dim), experts split on dim 1 over edp (1): 2 + 2
        self.assertExpectedInline(str(counts), """{'c10d.alltoall_base_': 4}""")
        self._check(groups, ref, "dp4_ep2")
        self.assertIn("layers.0.moe.experts.w1", groups.muon_names)
        bufs = {n: _full(muon.state[p]["momentum_buffer"]).clone()
                for n, p in zip(groups.muon_names, groups.muon)}
        path = [tempfile.mkdtemp(prefix="dtensor_moe_muon_") if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        try:
            dcp.save(get_optimizer_state_dict(model, muon), checkpoint_id=path[0])
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            dcp.save(get_model_state_dict(model), checkpoint_id=path[0] + "_model")
            model2, groups2, muon2, adamw2 = _build("dp2_tp2_etp", seed=7)
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            mstate = get_model_state_dict(model2)
            dcp.load(mstate, checkpoint_id=path[0] + "_model")
            set_model_state_dict(model2, mstate)
            ostate = get_optimizer_state_dict(model2, muon2)
            dcp.load(ostate, checkpoint_id=path[0])
            set_optimizer_state_dict(model2, muon2, ostate)
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path[0], ignore_errors=True)
                shutil.rmtree(path[0] + "_model", ignore_errors=True)
        for n, p in zip(groups2.muon_names, groups2.muon):
            buf = muon2.state[p]["momentum_buffer"]
            self.assertEqual(buf.placements, p.placements, n)
            self.assertTrue(torch.equal(_full(buf), bufs[n]), n)
        self._check(groups2, ref, "resumed at dp2_tp2_etp")
        counts = self._train("dp2_tp2_etp", model2, groups2, muon2, adamw2, ref, range(3, 5))
        self._check(groups2, ref, "dp2_tp2_etp")
        # dense TP matrices on (dp, tp) gather over both dims (4), shared experts (Replicate on
        # tp) over dp (2), experts split by expert TP over etp (2; edp splits the expert dim)
        self.assertExpectedInline(str(counts), """{'c10d.alltoall_base_': 8}""")


# pp2 x (dp2 x ep2): stage -> [(name, mesh key, shape, placements)]; the stages differ in their
# number of params and of exchanges, so a collective that crossed stages would hang or mix
STAGES = {
    0: [("s0.dense_rows", "dense_dp", (7, 6), (Shard(0),)),
        ("s0.dense_cols", "dense_dp", (5, 8), (Shard(1),)),
        ("s0.experts_ep", "expert_ep", (4, 6, 5), (Shard(0),))],
    1: [("s1.dense_rows", "dense_dp", (6, 6), (Shard(0),)),
        ("s1.plain", None, (3, 3), None),
        ("s1.experts_dim1", "expert_ep", (2, 4, 6), (Shard(1),))],
}


class MuonPipelineTest(DistTestBase):
    @with_comms
    def test_each_stage_steps_its_own_params_exactly(self):
        # Each stage's Muon, after clip_grad_norm_ over both stages (pp_mesh), equals
        # torch.optim.Muon on the gathered clipped grads bit for bit; collectives stay in the
        # stage: stage 0 one exchange (2 all-to-alls), stage 1 two (4).
        meshes = build_moe_meshes(pp=2, dp=2, ep=2)
        stage = meshes.pp_rank
        keyed = {"dense_dp": meshes.dense["dp"], "expert_ep": meshes.expert["ep"]}
        params = []
        for name, key, shape, placements in STAGES[stage]:
            full = _full_tensor(name, -1, shape)
            p = full if key is None else distribute_tensor(full, keyed[key], placements)
            params.append(p.requires_grad_())
        opt = Muon(params, **KW)
        ref = _TorchMuonOnFull(params)
        counts = None
        for step in range(STEPS):
            for p, (name, key, shape, placements) in zip(params, STAGES[stage], strict=True):
                g = _full_tensor(name, step, shape)
                p.grad = g if key is None else distribute_tensor(g, keyed[key], placements)
            dtensor_moe.clip_grad_norm_(params, 0.5, pp_mesh=meshes.pp_mesh)
            ref.step([_full(p.grad) for p in params])
            with CommDebugMode() as comm:
                opt.step()
            counts = counts or {str(k): v for k, v in comm.get_comm_counts().items()}
        for (name, *_), p, r in zip(STAGES[stage], params, ref.params(), strict=True):
            self.assertTrue(torch.equal(_full(p).detach(), r), name)
        expected = {0: "{'c10d.alltoall_base_': 2}", 1: "{'c10d.alltoall_base_': 4}"}
        self.assertEqual(str(counts), expected[stage])


def _full_tensor(name: str, step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 10 + step + 1)
    return torch.randn(shape, generator=gen)
