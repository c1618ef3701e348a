"""``update_expert_bias`` warns when a parallelized model would update its bias per rank."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, MoEConfig, build_moe_meshes, parallelize_moe
from dtensor_moe.moe import update_expert_bias
from tests._dist import DistTestBase

CONFIG = MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2, use_expert_bias=True)


def _ep4_moe() -> MoE:
    meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
    return parallelize_moe(MoE(CONFIG), meshes, sequence_parallel=False)


class BiasSyncWarningTest(DistTestBase):
    def _bias_deltas(self, model, x, **kwargs) -> list[torch.Tensor]:
        """Every rank's change of the bias from one forward and one update."""
        before = model.router.expert_bias.clone()
        model(x)
        update_expert_bias(model, 1e-2, **kwargs)
        delta = model.router.expert_bias - before
        gathered = [torch.zeros_like(delta) for _ in range(self.world_size)]
        dist.all_gather(gathered, delta)
        return gathered

    @with_comms
    def test_warns_once_for_parallel_models_without_a_group(self):
        torch.manual_seed(0)
        model = _ep4_moe()
        x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(self.rank))
        with self.assertWarnsRegex(UserWarning, "process_group=dist.group.WORLD"):
            deltas = self._bias_deltas(model, x)
        # what the warning is about: ranks routing different tokens update differently
        self.assertTrue(any(not torch.equal(d, deltas[0]) for d in deltas), deltas)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self._bias_deltas(model, x)  # once per module
            plain = MoE(CONFIG)  # plain params: a local model, no warning
            plain(x)
            update_expert_bias(plain, 1e-2)
            deltas = self._bias_deltas(_ep4_moe(), x, process_group=dist.group.WORLD)
        for d in deltas:  # with the group every rank applies the same update
            self.assertEqual(d, deltas[0])


if __name__ == "__main__":
    run_tests()
