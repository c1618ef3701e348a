"""Note [Ranks with identical tokens]: expert parallelism over ranks that route the same tokens
is caught on the first training forward, on every rank, with one all-gather, and the message
says how to fix it. Different data, evaluation, and the token-parallel layouts pass."""

# ruff: noqa: N806

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import ExpertParallel, MoE, MoEConfig, PrepareMoEInput, _compat
from tests._dist import DistTestBase

D = 8
IDENTICAL = r"route identical tokens .*PrepareMoEInput\(routing='split'\).*different data"


def _moe() -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(dim=D, hidden_dim=16, num_experts=4, top_k=2))


def _all_gathers(mode: CommDebugMode) -> int:
    return sum(v for k, v in mode.get_comm_counts().items() if "all_gather" in str(k))


class IdenticalTokensTest(DistTestBase):
    def _ep(self) -> tuple[MoE, object]:
        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("ep",))
        moe = _moe()
        parallelize_module(moe, mesh, {"experts": ExpertParallel()})
        return moe, mesh

    def _x(self, seed: int) -> torch.Tensor:
        return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed))

    @with_comms
    def test_every_rank_raises_when_all_ranks_hold_the_same_tokens(self):
        moe, _ = self._ep()
        with self.assertRaisesRegex(ValueError, r"ranks 0 and 1 " + IDENTICAL):
            moe(self._x(0))

    @with_comms
    def test_two_ranks_with_the_same_tokens_are_named(self):
        moe, _ = self._ep()
        seed = {0: 0, 1: 1, 2: 2, 3: 1}[self.rank]  # ranks 1 and 3 hold the same batch
        with self.assertRaisesRegex(ValueError, r"ranks 1 and 3 " + IDENTICAL):
            moe(self._x(seed))

    @with_comms
    def test_plan_on_a_tp_group_without_prepare_moe_input(self):
        # The case: the plan dict applied to the tp group of a block, whose ranks hold
        # the same (replicated) activation, without PrepareMoEInput.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        moe = _moe()
        parallelize_module(moe, mesh["tp"], {"experts": ExpertParallel()})
        dp_rank = mesh.get_coordinate()[0]
        with self.assertRaisesRegex(ValueError, IDENTICAL):
            moe(self._x(dp_rank))

    @with_comms
    def test_with_prepare_moe_input_the_tp_ranks_pass(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        moe = _moe()
        parallelize_module(moe, tp, {"experts": ExpertParallel(),
                                     "": PrepareMoEInput(input_layout=Shard(1))})
        x = distribute_tensor(self._x(mesh.get_coordinate()[0]), tp, [Shard(1)])
        moe(x).to_local().sum().backward()
        self.assertTrue(moe.experts.exchange.tokens_checked)

    @with_comms
    def test_different_data_checks_once_with_one_all_gather(self):
        moe, _ = self._ep()
        counts = []
        for step in range(2):
            with CommDebugMode() as mode:
                moe(self._x(10 * step + self.rank)).sum().backward()
            counts.append(_all_gathers(mode))
        self.assertEqual(counts, [1, 0])
        self.assertTrue(moe.experts.exchange.tokens_checked)
        # Checked once: the same tokens later are not looked at again...
        moe(self._x(0)).sum().backward()
        # ...except under TORCH_DISTRIBUTED_DEBUG=DETAIL, which checks every forward.
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            with self.assertRaisesRegex(ValueError, IDENTICAL):
                moe(self._x(0))
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)

    @with_comms
    def test_evaluation_is_not_checked(self):
        moe, _ = self._ep()
        with torch.no_grad(), CommDebugMode() as mode:
            y = moe(self._x(0))  # every rank evaluates the same batch: legitimate
        self.assertEqual(_all_gathers(mode), 0)
        self.assertFalse(moe.experts.exchange.tokens_checked)
        self.assertEqual(y.shape, (2, 5, D))

    @with_comms
    def test_pipeline_metadata_inference_is_not_checked(self):
        # torch's shape pass of a PipelineStage without static metadata runs the stages after
        # the first on uninitialised buffers, which may be equal on every rank: the check waits
        # for the first real forward (the pass's detection: tests/test_pp_router_traps.py)
        moe, _ = self._ep()
        with mock.patch.object(_compat, "in_pipeline_metadata_inference", return_value=True):
            moe(self._x(0).requires_grad_())
        self.assertFalse(moe.experts.exchange.tokens_checked)
        with self.assertRaisesRegex(ValueError, r"ranks 0 and 1 " + IDENTICAL):
            moe(self._x(0).requires_grad_())

    @with_comms
    def test_ranks_without_tokens_prove_nothing(self):
        moe, _ = self._ep()
        x = self._x(self.rank) if self.rank < 2 else torch.zeros(0, 5, D)
        x = x if self.rank != 3 else torch.zeros(2, 5, D)  # all-zero tokens are skipped too
        y = moe(x.requires_grad_())
        y.sum().backward()
        self.assertTrue(moe.experts.exchange.tokens_checked)


if __name__ == "__main__":
    run_tests()
