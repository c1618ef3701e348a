"""Multi-process (gloo, 4 ranks) tests of ``dtensor_moe.clip_grad_norm_`` over mixed meshes.

Every subcase compares with ``torch.nn.utils.clip_grad_norm_`` on the full single-device grads.
"""

from __future__ import annotations

import itertools
import math
import re

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe
from tests._dist import DistTestBase

# (name, mesh key, shape, placements); mesh key None is a plain tensor. Each row is a layout
# whose elements must be counted exactly once (Note [Count each element once] in clip.py).
GRAD_LAYOUT = [
    ("world_s0_uneven", "world", (7, 5), (Shard(0),)),
    ("world_s0_empty_shard", "world", (3, 2), (Shard(0),)),  # rank 3 holds 0 rows
    ("world_s1", "world", (6, 8), (Shard(1),)),
    ("world_rep", "world", (3, 4), (Replicate(),)),
    ("world_partial", "world", (5, 3), (Partial(),)),
    ("2d_s0_s1", "2d", (7, 6), (Shard(0), Shard(1))),
    ("2d_rep_s0_uneven", "2d", (9, 4), (Replicate(), Shard(0))),
    ("2d_partial_s1", "2d", (4, 6), (Partial(), Shard(1))),
    # what FSDP2 makes of a tp-sharded dim 0: _StridedShard is not a Shard subclass in torch 2.13
    ("2d_strided_s0", "2d", (8, 3), (_StridedShard(0, split_factor=2), Shard(0))),
    ("tp_s0_uneven", "tp", (7, 3), (Shard(0),)),
    ("tp_rep", "tp", (5,), (Replicate(),)),
    ("tp_partial_avg", "tp", (3, 3), (Partial("avg"),)),
    ("plain", None, (4, 4), None),
]
NORM_TYPES = (1.0, 2.0, math.inf, 3.0, 0.5)
RTOL = 1e-6
clip = dtensor_moe.clip_grad_norm_


def _build_meshes() -> dict[str, DeviceMesh]:
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"world": init_device_mesh("cpu", (4,)), "2d": mesh2d, "tp": mesh2d["tp"]}


def _pieces(shape, placements, mesh: DeviceMesh, gen) -> list[torch.Tensor]:
    """Dyadic summands, one per coordinate of the Partial dims, so any sum order is exact."""
    n = math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_partial())
    return [torch.randint(-64, 65, shape, generator=gen) / 16.0 for _ in range(n)]


def _partial_dtensor(pieces, mesh: DeviceMesh, placements) -> tuple[DTensor, torch.Tensor]:
    """A DTensor holding this rank's piece on the Partial dims; also the full reduced tensor."""
    partial_dims = [d for d, p in enumerate(placements) if p.is_partial()]
    coordinate = mesh.get_coordinate()
    index = 0
    for d in partial_dims:
        index = index * mesh.size(d) + coordinate[d]
    full = torch.stack(pieces).sum(0)
    if any(placements[d].reduce_op == "avg" for d in partial_dims):
        full = full / len(pieces)
    local_placements = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(pieces[index], mesh, local_placements, src_data_rank=None).to_local()
    dt = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    return dt, full


def _build_grads(meshes, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(distributed grads, full single-device grads), identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    dist_grads, full_grads = [], []
    for i, (_, key, shape, placements) in enumerate(GRAD_LAYOUT):
        if key is None:
            full = torch.randn(shape, generator=gen)
            dist_grads.append(full.clone())
        elif any(p.is_partial() for p in placements):
            pieces = _pieces(shape, placements, meshes[key], gen)
            dt, full = _partial_dtensor(pieces, meshes[key], placements)
            dist_grads.append(dt)
        else:
            full = torch.randn(shape, generator=gen) * (1 + i)  # varied scales for the inf norm
            dist_grads.append(
                distribute_tensor(full.clone(), meshes[key], placements, src_data_rank=None)
            )
        full_grads.append(full)
    return dist_grads, full_grads


def _param(grad: torch.Tensor) -> torch.Tensor:
    """A param (plain or DTensor, like ``grad``) whose ``.grad`` is ``grad``."""
    param = torch.empty_like(grad)
    param.grad = grad
    return param


def _with_grads(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Params carrying ``grads`` (in order), with two params without a grad in between."""
    params = [_param(g) for g in grads]
    no_grad = [torch.ones(3), torch.ones(2, 2)]
    if isinstance(grads[0], DTensor):
        no_grad[1] = distribute_tensor(
            no_grad[1], grads[0].device_mesh, [Replicate()], src_data_rank=None
        )
    return params[:3] + no_grad + params[3:]


def _comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k): v for k, v in sorted(mode.get_comm_counts().items(), key=str)}


class ClipGradNormAcrossMeshesTest(DistTestBase):
    """World size 4 on gloo/CPU (``DTensorTestBase`` with forked workers, see tests/_dist.py)."""

    def _check_against_torch(self, meshes, max_norm, norm_type, foreach, seed=0):
        grads, full = _build_grads(meshes, seed)
        params = _with_grads(grads)
        ref_params = _with_grads([f.clone() for f in full])
        ours = clip(params, max_norm, norm_type, foreach=foreach)
        ref = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type, foreach=foreach)
        msg = f"norm_type={norm_type}, foreach={foreach}, max_norm={max_norm}"
        self.assertNotIsInstance(ours, DTensor)
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=0, msg=msg)
        ref_grads = [p.grad for p in ref_params if p.grad is not None]
        for (name, *_), g, ref_g in zip(GRAD_LAYOUT, grads, ref_grads, strict=True):
            got = g.full_tensor() if isinstance(g, DTensor) else g
            torch.testing.assert_close(got, ref_g, rtol=RTOL, atol=1e-6, msg=f"{name}: {msg}")
        return ours

    @with_comms
    def test_matches_torch_on_mixed_meshes(self):
        meshes = _build_meshes()
        for norm_type, foreach in itertools.product(NORM_TYPES, (True, False, None)):
            self._check_against_torch(meshes, 1.0, norm_type, foreach)
        # no clipping (coef clamps to 1) and a generator / a single tensor as input
        self._check_against_torch(meshes, 1e9, 2.0, None)
        grads, full = _build_grads(meshes)
        total = clip((p for p in _with_grads(grads)), 1.0)
        ref = torch.nn.utils.clip_grad_norm_(_with_grads(full), 1.0)
        torch.testing.assert_close(total, ref, rtol=RTOL, atol=0)
        single = _with_grads(grads)[0]
        total = clip(single, 0.5, 3.0)
        ref_single = _with_grads(full)[0]
        ref = torch.nn.utils.clip_grad_norm_(ref_single, 0.5, 3.0)
        torch.testing.assert_close(total, ref, rtol=RTOL, atol=0)
        torch.testing.assert_close(single.grad.full_tensor(), ref_single.grad, rtol=RTOL, atol=0)
        # meshes= of one stage (pp == 1): the same as without it, no extra collective
        moe_meshes = dtensor_moe.build_moe_meshes(dp=4, ep=1)
        grads, full = _build_grads(meshes)
        with CommDebugMode() as with_meshes:
            total = clip(_with_grads(grads), 1e9, meshes=moe_meshes)
        with CommDebugMode() as without:
            clip(_with_grads(grads), 1e9)
        torch.testing.assert_close(total, torch.nn.utils.get_total_norm(full), rtol=RTOL, atol=0)
        self.assertEqual(with_meshes.get_comm_counts(), without.get_comm_counts())
        with self.assertRaisesRegex(ValueError, r"pp_mesh=.* was given with meshes of one "
                                    r"pipeline stage \(meshes.pp == 1\); leave pp_mesh out"):
            clip(_with_grads(grads), 1.0, pp_mesh=moe_meshes.dense["dp"], meshes=moe_meshes)
        # why this function exists: torch's own stacks per-grad norms across meshes
        dtensor_params = [_param(g) for g in _build_grads(meshes)[0] if isinstance(g, DTensor)]
        with self.assertRaisesRegex(RuntimeError, "must have the same mesh"):
            torch.nn.utils.clip_grad_norm_(dtensor_params, 1.0)
        for bad, norm_type in itertools.product((math.inf, math.nan), (2.0, math.inf, 0.5)):
            self._check_nonfinite(meshes["world"], bad, norm_type)

    @with_comms
    def test_collective_counts_and_errors(self):
        """One all-reduce per sharded mesh dim per mesh, plus one per Partial dim per group.

        User mistakes raise on every rank before any collective.
        """
        meshes = _build_meshes()
        counts = {}
        for label, norm_type in (("mixed layout, p=2", 2.0), ("mixed layout, p=inf", math.inf)):
            params = _with_grads(_build_grads(meshes)[0])
            with CommDebugMode() as mode:
                clip(params, 1.0, norm_type)
            counts[label] = _comm_counts(mode)
        grads, _ = _build_grads(meshes)
        replicated = [
            g for g, (*_, pl) in zip(grads, GRAD_LAYOUT) if pl in (None, (Replicate(),))
        ]
        world = meshes["world"]
        many = [distribute_tensor(torch.ones(7, 3), world, [Shard(0)]) for _ in range(20)]
        for label, gs in (("replicate and plain only", replicated), ("20 grads, 1 mesh", many)):
            with CommDebugMode() as mode:
                clip(_with_grads(gs), 1.0)
            counts[label] = _comm_counts(mode)
        # world: 1 (Shard dim) + 1 (Partial); 2d: 2 (both dims sharded) + 1 (Partial on dp);
        # tp: 1 (Shard dim) + 1 (Partial avg). Replicated and plain grads need none.
        self.assertExpectedInline(
            "\n".join(f"{label}: {c}" for label, c in counts.items()),
            """\
mixed layout, p=2: {'c10d.allreduce_': 7}
mixed layout, p=inf: {'c10d.allreduce_': 7}
replicate and plain only: {}
20 grads, 1 mesh: {'c10d.allreduce_': 1}""",
        )
        with CommDebugMode() as mode:
            self._check_errors(meshes)
        self.assertEqual(mode.get_total_counts(), 0, "errors must come before any collective")
        # empty input, params without grads, empty generator: tensor(0.0) like torch
        self.assertEqual(clip([], 1.0), torch.tensor(0.0))
        self.assertEqual(clip([torch.ones(2)], 1.0, norm_type=math.inf), torch.tensor(0.0))
        with self.assertWarnsRegex(UserWarning, "empty generator"):
            self.assertEqual(clip((p for p in []), 1.0), torch.tensor(0.0))
        # a mesh without this rank: documented error on ranks 2 and 3; ranks 0 and 1 clip
        half = DeviceMesh("cpu", torch.tensor([0, 1]))
        full = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
        param = _param(distribute_tensor(full, half, [Shard(0)], src_data_rank=None))
        if self.rank >= 2:
            with self.assertRaisesRegex(ValueError, f"which does not contain rank {self.rank}"):
                clip([param], 1.0)
        else:
            torch.testing.assert_close(clip([param], 1.0), full.norm(), rtol=RTOL, atol=0)

    def _check_nonfinite(self, mesh, bad: float, norm_type: float):
        """A nan/inf on one rank's shard only: every rank raises, or clips like torch."""
        full = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
        full[6, 4] = bad  # on rank 3's shard (7 rows over 4 ranks: 2, 2, 2, 1)
        param = _param(distribute_tensor(full.clone(), mesh, [Shard(0)], src_data_rank=None))
        ref = _param(full.clone())
        with self.assertRaises(RuntimeError) as ref_error:
            torch.nn.utils.clip_grad_norm_([ref], 1.0, norm_type, error_if_nonfinite=True)
        with self.assertRaisesRegex(RuntimeError, re.escape(str(ref_error.exception))):
            clip([param], 1.0, norm_type, error_if_nonfinite=True)
        torch.testing.assert_close(param.grad.full_tensor(), full, equal_nan=True)  # untouched
        total = clip([param], 1.0, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_([ref], 1.0, norm_type)
        torch.testing.assert_close(total, ref_total, equal_nan=True)
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad, equal_nan=True)

    def _check_errors(self, meshes):
        """Every user mistake raises on every rank, before any collective."""
        param = _param(torch.ones(7, 5))
        for norm_type in (0, -1.0, math.nan, -math.inf):
            with self.assertRaisesRegex(ValueError, "norm_type must be a number > 0 or inf"):
                clip([param], 1.0, norm_type)
        with self.assertRaisesRegex(TypeError, "norm_type must be a number"):
            clip([param], 1.0, "two")
        for max_norm in (-1.0, math.nan):
            with self.assertRaisesRegex(ValueError, "max_norm must be >= 0"):
                clip([param], max_norm)
        with self.assertRaisesRegex(TypeError, "max_norm must be a number"):
            clip([param], None)
        with self.assertRaisesRegex(TypeError, r"parameters\[1\] is a float, not a tensor"):
            clip([param, 1.0], 1.0)
        meta = _param(torch.empty(3, device="meta"))
        with self.assertRaisesRegex(RuntimeError, "can't use the foreach API on meta tensors"):
            clip([meta], 1.0, foreach=True)
        product = DTensor.from_local(torch.ones(2), meshes["world"], [Partial("product")])
        with self.assertRaisesRegex(ValueError, r"\[0\]\.grad is Partial\('product'\); supported"):
            clip([_param(product)], 1.0)


if __name__ == "__main__":
    run_tests()
