"""``reduce_gradients`` without pipeline parallelism, and the pipeline helpers ``split_stage``,
``build_stage`` and ``check_batch``, on 4 gloo ranks.

Under pipeline schedules (pp2 x dp2 x ep2, with FSDP2 in every stage or in one) the helper is
exercised by every test of ``tests/test_pipeline_schedule.py``, whose grads are reduced by it.
"""

# ruff: noqa: N806

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes, parallelize_moe
from dtensor_moe.parallel import build_stage, check_batch, reduce_gradients, split_stage
from tests._dist import DistTestBase
from tests._moe_model import DIM, VOCAB, global_batch, lm_loss, make_model
from tests.test_parallel_moe import close
from tests.test_pipeline_schedule import N_MICRO, L, PipeLM, b, loss_fn


class ReduceGradientsTest(DistTestBase):
    @with_comms
    def test_dp4_ep2_matches_one_process(self):
        # edp = 2: two copies of every expert, each summed over its EP group by the exchange;
        # the dense grads are four copies. Against the mean loss over the global batch.
        meshes = build_moe_meshes(dp=4, ep=2, device_type="cpu")
        self.assertEqual(meshes.edp, 2)
        model, ref = make_model(), make_model()
        parallelize_moe(model, meshes, sequence_parallel=False)
        T = global_batch(0, 4 * 2, 5)
        d = meshes.dense.get_local_rank("dp")
        lm_loss(model, T[2 * d : 2 * d + 2]).backward()
        lm_loss(ref, T).backward()
        reduce_gradients(model, meshes)
        ref_params = dict(ref.named_parameters())
        experts = 0
        for name, param in model.named_parameters():
            grad = param.grad
            experts += isinstance(grad, DTensor)
            close(grad.full_tensor() if isinstance(grad, DTensor) else grad,
                  ref_params[name].grad, name)
        self.assertGreater(experts, 0)
        # a second call before the next backward would divide again: refused on every rank
        with self.assertRaisesRegex(ValueError, "already reduced .* once per optimizer step"):
            reduce_gradients(model, meshes)
        lm_loss(model, T[2 * d : 2 * d + 2]).backward()  # the next step's backward: accepted
        reduce_gradients(model, meshes)
        # a gradient assigned with no hook firing (as the zero-bubble schedules' weight pass
        # does), at the version the mark holds: CPython gives the new tensor the freed one's
        # address, so a mark by id() took it for the reduced one and refused the next step
        # (a false error that came and went with the allocator, under load)
        same_id = 0
        for param in model.parameters():
            old_id, version = id(param.grad), param.grad._local_tensor._version if isinstance(
                param.grad, DTensor) else param.grad._version  # fmt: skip
            param.grad = None
            fresh = torch.zeros_like(param).to_local() if isinstance(param, DTensor) else \
                torch.zeros_like(param)  # fmt: skip
            for _ in range(version):
                fresh.add_(1.0)  # the version the mark holds
            param.grad = (DTensor.from_local(fresh, param.device_mesh, param.placements)
                          if isinstance(param, DTensor) else fresh)  # fmt: skip
            del fresh
            same_id += id(param.grad) == old_id
        self.assertGreater(same_id, 0)  # the case the weak reference is for did occur
        reduce_gradients(model, meshes)  # accepted: new gradients, whatever their ids
        with self.assertRaisesRegex(TypeError, "meshes must be the MoEMeshes"):
            reduce_gradients(model, None)

    @with_comms
    def test_built_stage_and_batch_check(self):
        # split_stage + build_stage: the full model's names, static metadata, one step trains;
        # check_batch raises the same error on every rank for rows that do not split
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        s = meshes.pp_rank
        module = split_stage(PipeLM(), s, 2, first=("embed",), last=("norm", "head"))
        self.assertEqual(sorted(module.layers), ["0", "1"] if s == 0 else ["2", "3"])
        self.assertEqual(module.embed is None, s == 1)
        parallelize_moe(module, meshes, sequence_parallel=False)
        hidden = torch.empty(b, L, DIM)
        stage = build_stage(
            module, meshes, stage_index=s, num_stages=2,
            input_args=torch.empty(b, L, dtype=torch.long) if s == 0 else hidden,
            output_args=torch.empty(b, L, VOCAB) if s == 1 else hidden,
        )
        schedule = Schedule1F1B(stage, N_MICRO, loss_fn=loss_fn)
        d = meshes.dense.get_local_rank("dp")  # each pipeline its own rows
        T = global_batch(1, 2 * N_MICRO * b, L)[d * N_MICRO * b : (d + 1) * N_MICRO * b]
        inputs, target = (T[:, :-1], None) if s == 0 else (None, T[:, 1:])
        check_batch(schedule, inputs=inputs, target=target)
        losses: list = []
        if s == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=losses)
            self.assertEqual(len(losses), N_MICRO)
        self.assertTrue(all(p.grad is not None for p in module.parameters()))
        short = T[: N_MICRO * b - 2]  # 6 rows for 4 micro-batches of 2
        with self.assertRaisesRegex(ValueError, r"rank 0's inputs have 6 rows, but its schedule "
                                    r"runs 4 micro-batches of 2 rows .* 8 rows per step"):
            check_batch(schedule, inputs=short[:, :-1] if s == 0 else None,
                        target=None if s == 0 else T[:, 1:])


class SplitStageTest(torch.testing._internal.common_utils.TestCase):
    def test_errors(self):
        class Listed(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(4)])

        with self.assertRaisesRegex(TypeError, r"model.layers must be an nn.ModuleDict .* "
                                    r"renumbers it"):
            split_stage(Listed(), 0, 2)
        with self.assertRaisesRegex(ValueError, "4 layers do not split evenly into 3 stages"):
            split_stage(PipeLM(), 0, 3)
        with self.assertRaisesRegex(ValueError, r"layers_per_stage=\[1, 1\] must hold 2 counts"):
            split_stage(PipeLM(), 0, 2, layers_per_stage=[1, 1])
        with self.assertRaisesRegex(ValueError, r"no module named \['embedding'\]"):
            split_stage(PipeLM(), 0, 2, first=("embedding",))
        module = split_stage(PipeLM(), 1, 2, layers_per_stage=[1, 3], last=("head",))
        self.assertEqual(list(module.layers), ["1", "2", "3"])
        self.assertIsNotNone(module.head)


if __name__ == "__main__":
    run_tests()
