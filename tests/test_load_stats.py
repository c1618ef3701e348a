"""``dtensor_moe.moe.load_stats`` (tokens per expert, reduced in one collective).

One process: exact figures from hand-set counters, counts against top-k selections recomputed
here, names, ``reset=``, errors. Four gloo ranks: EP4, SP2+EP2 and expert TP2 (L = 7) against
the single-device layer's counts over the global batch, with the collectives of one call pinned.

Shape legend: B sequences, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe.moe import LayerLoad, load_stats
from tests._dist import DistTestBase
from tests.test_moe_layer import D, make_moe


def test_figures_from_hand_set_counters():
    model = nn.ModuleDict({"a": make_moe(num_experts=8), "b": make_moe(num_experts=4)})
    model["a"].router.tokens_per_expert.copy_(torch.tensor([0, 2, 4, 6, 0, 0, 4, 0]))
    model["b"].router.tokens_per_expert.copy_(torch.tensor([3, 3, 3, 3]))
    a, b = load_stats(model)
    assert a == LayerLoad(
        name="a",
        counts=(0, 2, 4, 6, 0, 0, 4, 0),
        total=16,
        min=0,
        max=6,
        mean=2.0,
        cv=math.sqrt((4 + 0 + 4 + 16 + 4 + 4 + 4 + 4) / 8) / 2.0,
        dead=(0, 4, 5, 7),
        dropped=0,
        dropped_per_expert=(0,) * 8,
    )
    assert (b.name, b.counts, b.min, b.max, b.mean, b.cv, b.dead) == (
        "b", (3, 3, 3, 3), 3, 3, 3.0, 0.0, ()
    )
    assert "a: tokens/expert min 0 max 6 mean 2.0 cv 1.12; dead experts 4/8" in a.line()
    assert model["a"].router.tokens_per_expert.sum() == 16  # not reset by default


def test_counts_match_selections_and_reset():
    moe = make_moe(num_experts=8, top_k=2)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(0))
    moe(x)
    moe(x[:1])
    expected = [0] * moe.config.num_experts
    for x_D in torch.cat([x, x[:1]]).reshape(-1, D):
        for e in torch.softmax(moe.router.gate.weight @ x_D, 0).topk(2).indices.tolist():
            expected[e] += 1
    (stats,) = load_stats(moe, reset=True)
    assert stats.name == "" and list(stats.counts) == expected and stats.total == 20 * 2
    assert moe.router.tokens_per_expert.sum() == 0
    (empty,) = load_stats(moe)
    assert empty.total == 0 and math.isnan(empty.cv) and len(empty.dead) == 8
    moe.eval()
    moe(x)  # eval forwards are not counted
    assert load_stats(moe)[0].total == 0


def test_errors():
    with pytest.raises(ValueError, match=r"load_stats found no MoE router in Linear; pass the "):
        load_stats(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"process_group='all' is not 'world', 'local' or a"):
        load_stats(make_moe(), process_group="all")


class LoadStatsTest(DistTestBase):
    @with_comms
    def test_global_counts_and_one_collective(self):
        from dtensor_moe.parallel import build_moe_meshes, parallelize_moe
        from tests.test_parallel_moe import LAYOUTS

        B, L = 2, 7
        for name in ("ep4", "sp2ep2", "etp2"):
            layout = LAYOUTS[name]
            meshes = build_moe_meshes(**layout.meshes, device_type="cpu")
            ref = make_moe(num_shared_experts=1)
            model = parallelize_moe(
                copy.deepcopy(ref), meshes, sequence_parallel=layout.sequence_parallel
            )
            X = torch.randn(meshes.dp * B, L, D, generator=torch.Generator().manual_seed(1))
            d = self.rank // meshes.tp
            for _ in range(2):  # counters accumulate over forwards
                ref(X)
                x = X[d * B : (d + 1) * B]
                if meshes.tp > 1:
                    placement = Shard(1) if layout.sequence_parallel else Replicate()
                    x = distribute_tensor(x, meshes.dense["tp"], [placement])
                model(x)
            with CommDebugMode() as comm:
                stats = load_stats(model, reset=True)
            self.assertEqual(comm.get_total_counts(), 1, f"{name}: {comm.get_comm_counts()}")
            with CommDebugMode() as comm:
                (expected,) = load_stats(ref, process_group="local")  # this process's own
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(stats, [expected], name)
            self.assertEqual(stats[0].total, 2 * meshes.dp * B * L * 2)
            self.assertEqual(load_stats(model)[0].total, 0)  # reset on every rank


if __name__ == "__main__":
    run_tests()
