"""Multi-process (gloo, 4 ranks) tests of ``clip_grad_norm_(..., pp_mesh=...)`` across stages.

Two pipeline stages of dp2 x ep2 (``build_moe_meshes(pp=2, dp=2, ep=2)``: stage 0 on ranks 0-1,
stage 1 on ranks 2-3), each holding its own params on its expert and dense meshes, and perhaps
plain tensors or no grad at all. Every rank builds the full grads of the whole model from one
seed; the reference is ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` on those full
grads, which never goes through our function.
"""

from __future__ import annotations

import math
import re
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal import common_distributed
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe
import dtensor_moe.optim.clip as clip_module
from tests._dist import DistTestBase

clip = dtensor_moe.clip_grad_norm_
# a rank left waiting in a collective fails the test after this many seconds, not 300
common_distributed.TIMEOUT_OVERRIDE["test_wrong_pp_mesh_raises_on_every_rank"] = 40
NORM_TYPES = (1.0, 2.0, 3.5, math.inf, 0.5)
RTOL = 1e-6
EXPERT_S0 = (Replicate(), Shard(0), Replicate())  # ("edp", "ep", "etp") = (1, 2, 1)

# The whole model: stage -> [(name, mesh key, shape, placements)]; mesh key None is a plain
# tensor. The stages hold different numbers of params, uneven shards included (5 rows over
# ep=2, 7 rows over dp=2). The scales grow with the row index, so the inf norm comes from
# stage 1 and reaches stage 0 only through the all-reduce over pp.
LAYOUTS = {
    "mixed": {
        0: [
            ("s0.experts.w13", "expert", (5, 3, 2), EXPERT_S0),
            ("s0.attn.fsdp", "dense", (7, 4), (Shard(0), Replicate())),
            ("s0.norm.rep", "dense", (3,), (Replicate(), Replicate())),
            ("s0.embed.plain", None, (4,), None),
        ],
        1: [
            ("s1.experts.w2", "expert", (4, 2, 3), EXPERT_S0),
            ("s1.head.fsdp_dim1", "dense", (3, 5), (Shard(1), Replicate())),
        ],
    },
    "stage 1 without grads": {
        0: [
            ("s0.experts.w13", "expert", (5, 3, 2), EXPERT_S0),
            ("s0.attn.fsdp", "dense", (7, 4), (Shard(0), Replicate())),
        ],
        1: [],
    },
    "stage 1 plain only": {
        0: [("s0.experts.w13", "expert", (5, 3, 2), EXPERT_S0)],
        1: [("s1.head.plain", None, (6, 2), None)],
    },
}


def _full_grads(layout, seed: int, dtypes=None) -> dict[int, list[torch.Tensor]]:
    """The full grad of every param of every stage, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    full, scale = {}, 1.0
    for stage, rows in layout.items():
        full[stage] = []
        for _, _, shape, _ in rows:
            grad = torch.randn(shape, generator=gen) * scale
            full[stage].append(grad.to((dtypes or {}).get(stage, torch.float32)))
            scale += 1.0
    return full


def _param(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    param = torch.empty_like(like)
    param.grad = grad
    return param


def _stage_params(meshes, rows, full: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's params of its stage, their grads distributed like the layout says, and a
    param without a grad on each mesh in between."""
    params = []
    for (_, key, _, placements), grad in zip(rows, full, strict=True):
        if key is None:
            params.append(_param(grad.clone(), grad))
        else:
            mesh = getattr(meshes, key)
            dt = distribute_tensor(grad.clone(), mesh, placements, src_data_rank=None)
            params.append(_param(dt, dt))
    dense = distribute_tensor(torch.ones(2, 2), meshes.dense, [Replicate(), Replicate()])
    return params[:1] + [_param(None, dense), _param(None, torch.ones(3))] + params[1:]


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k): v for k, v in sorted(mode.get_comm_counts().items(), key=str)}


class ClipAcrossStagesTest(DistTestBase):
    """pp2 x dp2 (x ep2 inside each stage) on 4 gloo ranks (forked workers, tests/_dist.py)."""

    def _meshes(self):
        meshes = dtensor_moe.build_moe_meshes(pp=2, dp=2, ep=2)
        self.assertEqual(meshes.pp_rank, self.rank // 2)
        return meshes

    def _check_against_torch(self, meshes, label, norm_type, foreach, pp, dtypes=None, seed=0):
        """Our total and clipped grads against torch's on the gathered grads of both stages."""
        layout = LAYOUTS[label]
        full = _full_grads(layout, seed, dtypes)
        params = _stage_params(meshes, layout[meshes.pp_rank], full[meshes.pp_rank])
        ours = clip(params, 0.5, norm_type, foreach=foreach, pp_mesh=pp)
        every_grad = [g.clone() for stage in sorted(full) for g in full[stage]]
        ref_total = torch.nn.utils.get_total_norm(every_grad, norm_type)
        ref_params = [_param(g, g) for g in every_grad]
        ref = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type, foreach=foreach)
        msg = f"{label}: norm_type={norm_type}, foreach={foreach}, dtypes={dtypes}"
        self.assertNotIsInstance(ours, DTensor)
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=0, msg=msg)
        torch.testing.assert_close(ours, ref_total, rtol=RTOL, atol=0, msg=msg)
        offset = sum(len(layout[s]) for s in layout if s < meshes.pp_rank)
        got = [_full(p.grad) for p in params if p.grad is not None]
        want = [p.grad for p in ref_params[offset : offset + len(got)]]
        self.assertEqual(len(got), len(layout[meshes.pp_rank]))
        for (name, *_), g, ref_g in zip(layout[meshes.pp_rank], got, want, strict=True):
            torch.testing.assert_close(g, ref_g, rtol=RTOL, atol=1e-6, msg=f"{name}: {msg}")
        return ours

    @with_comms
    def test_matches_torch_on_gathered_grads(self):
        meshes = self._meshes()
        for label in LAYOUTS:
            for norm_type in NORM_TYPES:
                for foreach in (None, False):
                    self._check_against_torch(meshes, label, norm_type, foreach, meshes.pp_mesh)
        # the ProcessGroup of the pp mesh gives the same; foreach=True too
        group = meshes.pp_mesh.get_group()
        for norm_type in (2.0, math.inf):
            self._check_against_torch(meshes, "mixed", norm_type, True, group)
        # stages in different dtypes: every rank returns fp64, like torch on the gathered grads
        for label in ("mixed", "stage 1 plain only"):
            for norm_type in (2.0, math.inf):
                total = self._check_against_torch(
                    meshes, label, norm_type, None, meshes.pp_mesh, {1: torch.float64}
                )
                self.assertEqual(total.dtype, torch.float64)
        # no grad on any stage: torch's tensor(0.0), still after the all-reduce over pp
        with CommDebugMode() as mode:
            total = clip([torch.ones(2)], 1.0, pp_mesh=meshes.pp_mesh)
        self.assertEqual(total, torch.nn.utils.clip_grad_norm_([torch.ones(2)], 1.0))
        self.assertEqual(mode.get_total_counts(), 1)

    @with_comms
    def test_one_more_all_reduce_than_without_pp(self):
        """Per stage: the all-reduces of its meshes without ``pp_mesh``, plus one with it."""
        meshes = self._meshes()
        counts = {}
        for label, layout in LAYOUTS.items():
            full = _full_grads(layout, seed=1)
            for pp in (None, meshes.pp_mesh):
                params = _stage_params(meshes, layout[meshes.pp_rank], full[meshes.pp_rank])
                for norm_type in (2.0, math.inf):
                    with CommDebugMode() as mode:
                        total = clip(params, 1e9, norm_type, pp_mesh=pp)
                    key = f"{label}, {'pp_mesh' if pp is not None else 'no pp'}, p={norm_type}"
                    counts[key] = _comm_counts(mode)
                if pp is None and layout[meshes.pp_rank]:
                    # without pp_mesh: the norm of this stage's grads only
                    stage_grads = [g.clone() for g in full[meshes.pp_rank]]
                    ref = torch.nn.utils.get_total_norm(stage_grads, math.inf)
                    torch.testing.assert_close(total, ref, rtol=RTOL, atol=0)
        every = [None] * self.world_size
        dist.all_gather_object(every, counts)
        lines = [
            f"stage {stage}, {key}: {every[2 * stage][key]}"
            for stage in (0, 1)
            for key in every[2 * stage]
            if key.endswith("p=2.0")
        ]
        for rank_counts in every:  # the inf norm costs the same as p=2, on every rank
            for key, value in rank_counts.items():
                self.assertEqual(value, rank_counts[key.replace("p=inf", "p=2.0")], key)
        self.assertEqual(every[0], every[1])
        self.assertEqual(every[2], every[3])
        self.assertExpectedInline(
            "\n".join(lines),
            """\
stage 0, mixed, no pp, p=2.0: {'c10d.allreduce_': 2}
stage 0, mixed, pp_mesh, p=2.0: {'c10d.allreduce_': 3}
stage 0, stage 1 without grads, no pp, p=2.0: {'c10d.allreduce_': 2}
stage 0, stage 1 without grads, pp_mesh, p=2.0: {'c10d.allreduce_': 3}
stage 0, stage 1 plain only, no pp, p=2.0: {'c10d.allreduce_': 1}
stage 0, stage 1 plain only, pp_mesh, p=2.0: {'c10d.allreduce_': 2}
stage 1, mixed, no pp, p=2.0: {'c10d.allreduce_': 2}
stage 1, mixed, pp_mesh, p=2.0: {'c10d.allreduce_': 3}
stage 1, stage 1 without grads, no pp, p=2.0: {}
stage 1, stage 1 without grads, pp_mesh, p=2.0: {'c10d.allreduce_': 1}
stage 1, stage 1 plain only, no pp, p=2.0: {}
stage 1, stage 1 plain only, pp_mesh, p=2.0: {'c10d.allreduce_': 1}""",
        )

    @with_comms
    def test_nonfinite_decided_on_every_rank(self):
        """A nan/inf on one rank of stage 1: every rank of both stages raises, or clips like
        torch; the grads stay untouched when it raises."""
        meshes = self._meshes()
        layout = LAYOUTS["mixed"]
        for bad in (math.nan, math.inf):
            for norm_type in (2.0, math.inf, 0.5):
                full = _full_grads(layout, seed=2)
                full[1][0][3, 1, 2] = bad  # row 3 of 4 over ep=2: on rank 3's shard only
                every_grad = [g for stage in (0, 1) for g in full[stage]]
                ref_params = [_param(g.clone(), g) for g in every_grad]
                with self.assertRaises(RuntimeError) as ref_error:
                    torch.nn.utils.clip_grad_norm_(ref_params, 1.0, norm_type, True)
                params = _stage_params(meshes, layout[meshes.pp_rank], full[meshes.pp_rank])
                with self.assertRaisesRegex(RuntimeError, re.escape(str(ref_error.exception))):
                    clip(params, 1.0, norm_type, True, pp_mesh=meshes.pp_mesh)
                got = [_full(p.grad) for p in params if p.grad is not None]
                for g, want in zip(got, full[meshes.pp_rank], strict=True):
                    torch.testing.assert_close(g, want, rtol=0, atol=0, equal_nan=True)
                total = clip(params, 1.0, norm_type, pp_mesh=meshes.pp_mesh)
                ref = torch.nn.utils.clip_grad_norm_(ref_params, 1.0, norm_type)
                torch.testing.assert_close(total, ref, equal_nan=True)
                offset = 0 if meshes.pp_rank == 0 else len(layout[0])
                mine = ref_params[offset : offset + len(layout[meshes.pp_rank])]
                got = [_full(p.grad) for p in params if p.grad is not None]
                for g, ref_p in zip(got, mine, strict=True):
                    torch.testing.assert_close(g, ref_p.grad, equal_nan=True)

    @with_comms
    def test_bad_pp_mesh_raises_before_any_collective(self):
        meshes = self._meshes()
        layout = LAYOUTS["mixed"]
        full = _full_grads(layout, seed=3)
        params = _stage_params(meshes, layout[meshes.pp_rank], full[meshes.pp_rank])
        # new_group is collective over every rank: build both pp groups on every rank
        pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        not_mine = pp_groups[1 - self.rank % 2]  # NON_GROUP_MEMBER on this rank
        with CommDebugMode() as mode:
            with self.assertRaisesRegex(
                TypeError, "pp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None, got str"
            ):
                clip(params, 1.0, pp_mesh="pp")
            with self.assertRaisesRegex(TypeError, "got int 2; pass meshes.pp_mesh"):
                clip(params, 1.0, pp_mesh=2)
            with self.assertRaisesRegex(ValueError, r"must be a 1-D DeviceMesh, got .*\(3-D\)"):
                clip(params, 1.0, pp_mesh=meshes.expert)
            with self.assertRaisesRegex(ValueError, f"does not contain rank {self.rank}"):
                clip(params, 1.0, pp_mesh=not_mine)
            # with meshes=: the stage's own ranks, or every rank, is not one rank per stage,
            # decided from the layout on every rank
            for wrong, ranks, stages in (
                (meshes.dense["dp"], re.escape(f"[{2 * meshes.pp_rank}, {2 * meshes.pp_rank + 1}]"),
                 re.escape(f"[{meshes.pp_rank}, {meshes.pp_rank}]")),
                (meshes.stage_group, None, None),
                (dist.group.WORLD, r"\[0, 1, 2, 3\]", r"\[0, 0, 1, 1\]"),
            ):
                with self.assertRaisesRegex(
                    ValueError,
                    rf"pp_mesh .* holds ranks {ranks or '.*'}, of stages {stages or '.*'}, but a "
                    r"pp_mesh is one rank of each of the meshes' 2 stages of 2 ranks \(this "
                    rf"stage: ranks \[{2 * meshes.pp_rank}, {2 * meshes.pp_rank + 1}\]\); leave "
                    "pp_mesh out and pass meshes=meshes",
                ):
                    clip(params, 1.0, pp_mesh=wrong, meshes=meshes)
            with self.assertRaisesRegex(TypeError, "meshes must be the MoEMeshes .*DeviceMesh"):
                clip(params, 1.0, meshes=meshes.dense)
            # the other checks still come first, on a stage with no grad too
            with self.assertRaisesRegex(ValueError, "norm_type must be a number > 0 or inf"):
                clip([], 1.0, 0.0, pp_mesh=meshes.pp_mesh)
        self.assertEqual(mode.get_total_counts(), 0, "errors must come before any collective")
        got = [_full(p.grad) for p in params if p.grad is not None]
        for g, want in zip(got, full[meshes.pp_rank], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=0)  # untouched
        # foreach=True on a device without foreach kernels (cpu pretends to be one): every
        # rank raises torch's error before any collective, the stage without grads too
        no_grads = [_param(None, torch.ones(2))]
        with patch.object(clip_module, "device_has_foreach_support", lambda device: False):
            with CommDebugMode() as mode:
                with self.assertRaisesRegex(RuntimeError, "can't use the foreach API on cpu"):
                    clip(params if meshes.pp_rank == 0 else no_grads, 1.0, foreach=True,
                         pp_mesh=meshes.pp_mesh)
        self.assertEqual(mode.get_total_counts(), 0)
        # the pp group of this rank, as a ProcessGroup, works; so does meshes= alone
        every = [g for stage in (0, 1) for g in full[stage]]
        for kwargs in (dict(pp_mesh=pp_groups[self.rank % 2]), dict(meshes=meshes),
                       dict(pp_mesh=meshes.pp_mesh, meshes=meshes)):
            total = clip(params, 1e9, **kwargs)
            torch.testing.assert_close(total, torch.nn.utils.get_total_norm(every), rtol=RTOL,
                                       atol=0, msg=str(kwargs))

    @with_comms
    def test_wrong_pp_mesh_raises_on_every_rank(self):
        """Without meshes=, a pp_mesh that is the world (or the stage's group): every rank
        raises after the one all-reduce over it, the stage whose grads are plain tensors or
        None too (it sees no mesh, and used to wait in the all-reduce); no grad is scaled."""
        meshes = self._meshes()
        for label in ("mixed", "stage 1 plain only", "stage 1 without grads"):
            layout = LAYOUTS[label]
            full = _full_grads(layout, seed=4)
            params = _stage_params(meshes, layout[meshes.pp_rank], full[meshes.pp_rank])
            # a group inside a stage of plain grads cannot be told from a pp group without
            # meshes=: the stage groups only where both stages hold DTensor grads
            wrongs = [dist.group.WORLD]
            if label == "mixed":
                wrongs += [meshes.dense["dp"], meshes.stage_group]
            for wrong in wrongs:
                sees = label == "mixed" or meshes.pp_rank == 0
                detail = r"on rank \d it shares ranks \[\d(, \d)*\] with DeviceMesh"
                if not sees:
                    detail = "on another rank it shares ranks with the mesh of a grad"
                with CommDebugMode() as mode:
                    with self.assertRaisesRegex(
                        ValueError,
                        rf"pp_mesh .* is not one rank per pipeline stage: {detail}.*, so grads "
                        r"would be counted more than once. Pass meshes=meshes",
                    ):
                        clip(params, 1.0, 2.0, pp_mesh=wrong)
                self.assertEqual(_comm_counts(mode), {"c10d.allreduce_": 1}, label)
                got = [_full(p.grad) for p in params if p.grad is not None]
                for g, want in zip(got, full[meshes.pp_rank], strict=True):
                    torch.testing.assert_close(g, want, rtol=0, atol=0)  # untouched


if __name__ == "__main__":
    run_tests()
