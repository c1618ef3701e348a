"""The fixed exchange (``exchange="fixed"``) compiled with inductor under the token-parallel
layouts, 4 gloo ranks: SP2 + EP2 (EP borrows the tp ranks) and EP2 x expert TP2, both with a
``Shard(1)`` (sequence-parallel) input. ``tests/test_fixed_exchange.py``'s
``test_compiled_training`` and ``test_compiled_evaluation_whole`` do the same under EP4, where
the layer has no token-parallel hooks.

After one eager step (the fixed exchange's one-time checks), ``torch.compile(layer)`` with
inductor over 5 training steps of new data, then in evaluation with ``fullgraph=True``: outputs,
``x.grad`` and every param grad match the same layer run eagerly at 1e-5 (grads: of each grad's
largest entry, as inductor's fused kernels round differently), and the graphs, breaks and
recompiles are pinned. ``torch.compile`` of a module runs its hooks outside the module's own
frame (torch 2.13, ``OptimizedModule._initialize`` in ``torch/_dynamo/eval_frame.py``: "Invoke
hooks outside of dynamo then pickup the inner frame"), so dynamo compiles
``PrepareMoEInput``'s input hook, ``MoE.forward`` and the output hook as separate frames:

* training: 2 graphs (the input hook; the forward up to the router's counter update, whose
  ``torch.compiler.disable`` is the one break, last; the rest of the forward and the output
  hook, a no-op for a ``Shard(1)`` input, hold no op), 1 break, no recompile;
* evaluation, ``torch.compile(layer, fullgraph=True)``: 3 graphs (input hook, forward, output
  hook), no break; the layer called from a compiled function, ``fullgraph=True``: 1 graph.

About 40 to 90 s a layout on 2 cores (most of it inductor compiling, 3 compiles per layout), so
both layouts run with ``DTENSOR_MOE_FULL_MATRIX=1`` only. CI covers the two halves of this file's
matrix elsewhere: the fixed exchange compiled with inductor, in training and in evaluation with
``fullgraph=True``, under EP4 (``tests/test_fixed_exchange.py``'s ``test_compiled_*``), and
the token-parallel hooks of SP2 + EP2 compiled, inductor included, with their graphs and breaks
pinned (``tests/test_parallel_compile.py``); the fixed exchange under SP2 + EP2 runs eagerly in
``tests/test_fixed_exchange.py``.

Shape legend: B sequences per data shard, L tokens per sequence, D dim.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import os
import unittest

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, build_moe_meshes, parallelize_moe
from tests._dist import DistTestBase

FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
from tests.test_exchange_backends import exchanges_of
from tests.test_parallel_moe import LAYOUTS, Case, make_config

CASE = Case(2, 8, 2, 1)  # tp divides L: the same buffer on every rank under SP
D = 16
STEPS = 5


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FixedCompileLayoutsTest(DistTestBase):
    def _check(self, name: str) -> dict[str, tuple[int, int, int]]:
        """Parity with eager in training and evaluation (module docstring); returns the
        (graphs, breaks, recompiles) of each phase."""
        layout = LAYOUTS[name]
        meshes = build_moe_meshes(**layout.meshes, device_type="cpu")
        torch.manual_seed(0)
        ref = MoE(make_config(CASE, aux_loss_coeff=0.0))
        eager, traced = (
            parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=True, exchange="fixed",
                            expert_tp_dispatch=layout.expert_tp_dispatch)
            for _ in range(2)
        )  # fmt: skip
        self.assertEqual(exchanges_of([eager, traced]), {"fixed"})
        tp = meshes.dense["tp"]
        g = torch.Generator().manual_seed(self.rank // meshes.tp)  # one batch per data shard
        xs = [distribute_tensor(torch.randn(CASE.B, CASE.L, D, generator=g), tp, [Shard(1)])
              for _ in range(STEPS + 1)]  # fmt: skip
        for model in (eager, traced):  # the one-time checks run eagerly
            _local(model(xs[0])).sum().backward()
            model.zero_grad()
        counts = {}
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(traced)
        for step, x in enumerate(xs[1:]):
            x_e, x_c = (x.detach().clone().requires_grad_() for _ in range(2))
            y_e, y_c = eager(x_e), compiled(x_c)
            _local(y_e).square().sum().backward()
            _local(y_c).square().sum().backward()
            where = f"{name} train step {step}"
            torch.testing.assert_close(_local(y_c), _local(y_e), rtol=1e-5, atol=1e-6, msg=where)
            pairs = [("x", x_e.grad, x_c.grad)] + [
                (n, a.grad, b.grad)
                for (n, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True)
            ]
            for n, ga, gb in pairs:
                ga, gb = _local(ga), _local(gb)
                scale = ga.abs().max().item()  # inductor's fusions round differently
                torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-5 * scale,
                                           msg=f"{where}: {n}.grad")  # fmt: skip
            eager.zero_grad()
            traced.zero_grad()
        counts["train"] = self._counts()
        eager.eval()
        traced.eval()
        torch._dynamo.reset()
        counters.clear()
        whole = torch.compile(traced, fullgraph=True)
        with torch.no_grad():
            for step, x in enumerate(xs[1:]):
                torch.testing.assert_close(_local(whole(x)), _local(eager(x)), rtol=1e-5,
                                           atol=1e-6, msg=f"{name} eval step {step}")  # fmt: skip
        counts["eval"] = self._counts()
        torch._dynamo.reset()
        counters.clear()
        inlined = torch.compile(lambda x: traced(x), fullgraph=True)  # hooks traced inline
        with torch.no_grad():
            for step, x in enumerate(xs[1:]):
                torch.testing.assert_close(_local(inlined(x)), _local(eager(x)), rtol=1e-5,
                                           atol=1e-6, msg=f"{name} eval inline {step}")  # fmt: skip
        counts["eval inline"] = self._counts()
        dist.barrier()
        return counts

    @staticmethod
    def _counts() -> tuple[int, int, int]:
        return (
            counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()),
            sum(counters["recompiles"].values()),
        )

    # (graphs, breaks, recompiles); see the module docstring
    PINNED = {"train": (2, 1, 0), "eval": (3, 0, 0), "eval inline": (1, 0, 0)}

    # a slow matrix entry (about 40 s): CI covers the fixed exchange compiled under EP4
    # (test_fixed_exchange.py's test_compiled_training and _evaluation_whole) and SP2 + EP2
    # compiled with the all-to-all exchange (test_parallel_compile.py);
    # DTENSOR_MOE_FULL_MATRIX=1 runs it
    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_sp2ep2_compiles_and_matches_eager(self):
        self.assertEqual(self._check("sp2ep2"), self.PINNED)

    @unittest.skipUnless(FULL, "a slow matrix entry: DTENSOR_MOE_FULL_MATRIX=1 runs it")
    @with_comms
    def test_ep2_expert_tp2_compiles_and_matches_eager(self):
        self.assertEqual(self._check("ep2tp2"), self.PINNED)


if __name__ == "__main__":
    run_tests()
