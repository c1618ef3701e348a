"""The parallel layouts compose around the layer's own forward.

Under every layout (EP, expert TP with both dispatches, EP x TP, SP with an uneven sequence
length), on 4 gloo ranks against the single-device layer (Note [One forward] in
``dtensor_moe/moe/tokens.py``):

* forward hooks and full backward hooks on ``moe.router``, ``moe.router.gate``,
  ``moe.shared_experts`` and ``moe.experts`` fire as many times as in one process;
* a LoRA-like ``nn.Linear`` subclass swapped in for ``moe.router.gate`` (before the styles)
  changes the result exactly as in one process;
* ``fully_shard`` applied separately to ``moe.router`` and ``moe.shared_experts`` (their own
  FSDP units) keeps parity over training steps;
* ``checkpoint_wrapper`` on ``moe.shared_experts`` keeps parity, and its forward runs again in
  backward.

Each check goes through ``ParallelRun`` of ``test_parallel_moe``: output, input gradient,
every parameter gradient and, after the steps, every parameter, at 1e-5 relative in fp32. CI
runs one layout per way of routing (:data:`COMPOSE_LAYOUTS`); ``DTENSOR_MOE_FULL_MATRIX=1``
runs every layout.
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE
from tests._dist import DistTestBase
from tests.test_parallel_moe import (
    LAYOUTS,
    STEPS,
    Case,
    ParallelRun,
    close,
    full,
    make_config,
)

CASE = Case(B=2, L=7, top_k=2, shared=1)  # uneven L over tp=2, shared experts on
COMPOSE_LAYOUTS = ("ep4", "etp2", "etp2_gather", "ep2tp2", "sp2ep2")
# CI: EP4, expert TP gathered ("replicate" routing) and SP2 + EP2 ("split" routing, uneven L):
# each way the router, the shared experts and the experts see the tokens. etp2 and ep2tp2 split
# the tokens as sp2ep2 does (their all-to-all expert-TP dispatch is checked against one process
# in test_parallel_moe.py); DTENSOR_MOE_FULL_MATRIX=1 runs every layout.
if os.environ.get("DTENSOR_MOE_FULL_MATRIX") != "1":
    COMPOSE_LAYOUTS = ("ep4", "etp2_gather", "sp2ep2")
HOOKED = ("router", "router.gate", "shared_experts", "experts")


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a rank-``r`` term ``B @ A``, as an adapter library would swap in."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__(base.in_features, base.out_features, bias=False)
        with torch.no_grad():
            self.weight.copy_(base.weight)
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, r) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class GatheringLinear(nn.Linear):
    """A gate that gathers its logits over the tp ranks: not row-wise, so not allowed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y.redistribute(placements=[Replicate()]) if isinstance(y, DTensor) else y


def _count_hooks(moe: nn.Module) -> Counter:
    counts: Counter = Counter()
    modules = dict(moe.named_modules())
    for name in HOOKED:
        module = modules[name]

        def forward_hook(mod, args, out, name=name):
            counts[f"{name} forward"] += 1

        def backward_hook(mod, grad_in, grad_out, name=name):
            counts[f"{name} backward"] += 1

        module.register_forward_hook(forward_hook)
        if name != "router":  # its output is a RouterOutput, not a tensor: no backward hook
            module.register_full_backward_hook(backward_hook)
    return counts


class ComposableTest(DistTestBase):
    @with_comms
    def test_dtensor_linear_on_short_sequence_shards(self):
        """Why a ``Shard(1)`` input with ``L < tp`` is routed as flat slices (Note [Short
        sequences under sequence parallelism]): on 4 ranks, a linear layer keeps ``Shard(1)``
        only when every rank holds part of the sequence. When torch keeps the split for these
        shapes, the workaround can go."""
        mesh = init_device_mesh("cpu", (4,))
        weight = distribute_tensor(torch.randn(3, 8), mesh, [Replicate()])
        for L, expected in ((4, Shard(1)), (6, Shard(1)), (3, Replicate()), (2, Replicate())):
            x = distribute_tensor(torch.randn(2, L, 8), mesh, [Shard(1)])
            self.assertEqual(F.linear(x, weight).placements, (expected,), f"L={L}")
        x = distribute_tensor(torch.randn(2, 1, 8), mesh, [Shard(1)])
        with self.assertRaisesRegex(RuntimeError, "reshape sharded dimension 1"):
            F.linear(x, weight)

    def _train(self, run: ParallelRun, where: str, check_grads=None) -> None:
        for step in range(STEPS):

            def check(actual, expected, what, step=step):
                close(actual, expected, f"{where} step {step}: {what}")

            if check_grads is None:
                run.step(check)
            else:
                check_grads(run, check)
        run.check_params(lambda a, e, w: close(a, e, f"{where}: {w}"))

    @with_comms
    def test_hooks_fire_as_in_one_process(self):
        for name in COMPOSE_LAYOUTS:
            run = ParallelRun(LAYOUTS[name], CASE, self.rank)
            ref_counts, counts = _count_hooks(run.ref), _count_hooks(run.model)
            self._train(run, f"{name} hooks")
            expected = {f"{n} forward": STEPS for n in HOOKED}
            expected.update({f"{n} backward": STEPS for n in HOOKED if n != "router"})
            self.assertEqual(dict(ref_counts), expected, f"{name}: single-process hook counts")
            self.assertEqual(dict(counts), expected, f"{name}: hook counts under the layout")

    @with_comms
    def test_gate_adapter_swap(self):
        torch.manual_seed(5)
        plain = MoE(make_config(CASE))
        x = torch.randn(2, CASE.L, plain.config.dim)
        swapped = copy.deepcopy(plain)
        swapped.router.gate = LoRALinear(swapped.router.gate)
        # the adapter changes the single-process result, so parity below means it acts
        self.assertFalse(torch.allclose(plain(x), swapped(x)), "the LoRA term changes nothing")

        def swap(moe: MoE) -> None:
            torch.manual_seed(6)
            moe.router.gate = LoRALinear(moe.router.gate)

        for name in COMPOSE_LAYOUTS:
            run = ParallelRun(LAYOUTS[name], CASE, self.rank, prepare=swap)
            self.assertIsInstance(run.model.router.gate, LoRALinear)
            self._train(run, f"{name} LoRA gate")

    @with_comms
    def test_gate_that_loses_the_token_split_raises(self):
        def swap(moe: MoE) -> None:
            gate = GatheringLinear(moe.config.dim, moe.config.num_experts, bias=False)
            gate.weight = moe.router.gate.weight
            moe.router.gate = gate

        run = ParallelRun(LAYOUTS["sp2ep2"], Case(B=2, L=8, top_k=2, shared=0), self.rank,
                          prepare=swap)
        with self.assertRaisesRegex(RuntimeError, "must act on each token separately"):
            run.forward_backward()

    @with_comms
    def test_call_with_extra_arguments_raises(self):
        run = ParallelRun(LAYOUTS["sp2ep2"], Case(B=2, L=8, top_k=2, shared=0), self.rank)
        x = torch.randn(2, 8, run.model.config.dim)
        msg = (r"an MoE under PrepareMoEInput is called as moe\(x\) with one positional input, "
               r"got 1 positional and keyword arguments \['tokens'\]")
        with self.assertRaisesRegex(TypeError, msg):
            run.model(x, tokens=None)
        with self.assertRaisesRegex(TypeError, r"got 2 positional and keyword arguments \[\]"):
            run.model(x, x)

    @with_comms
    def test_separate_fsdp_units_for_router_and_shared_experts(self):
        for name in COMPOSE_LAYOUTS:
            run = ParallelRun(LAYOUTS[name], CASE, self.rank)
            dp_mesh = run.meshes.dense["dp"]
            fully_shard(run.model.router, mesh=dp_mesh)
            fully_shard(run.model.shared_experts, mesh=dp_mesh)
            run.opt = torch.optim.AdamW(run.model.parameters(), lr=run.opt_ref.defaults["lr"],
                                        eps=run.opt_ref.defaults["eps"], fused=True)
            self._train(run, f"{name} fully_shard(router), fully_shard(shared_experts)",
                        check_grads=_step_with_fsdp_units)

    @with_comms
    def test_checkpoint_wrapper_on_shared_experts(self):
        def wrap(moe: MoE) -> None:
            moe.shared_experts = checkpoint_wrapper(moe.shared_experts)

        for name in COMPOSE_LAYOUTS:
            run = ParallelRun(LAYOUTS[name], CASE, self.rank, prepare=wrap)
            counts = Counter()
            inner = run.model.shared_experts._checkpoint_wrapped_module
            # a pre-hook: the recompute stops early, once it has what backward needs
            inner.register_forward_pre_hook(lambda *_: counts.update(["forward"]))
            self._train(run, f"{name} checkpoint_wrapper(shared_experts)")
            # each step's forward, and its recompute in backward
            self.assertEqual(counts["forward"], 2 * STEPS, f"{name}: shared forward count")


def _step_with_fsdp_units(run: ParallelRun, check) -> None:
    """``ParallelRun.step`` for a model whose router and shared experts are FSDP units: their
    gradients come out of FSDP averaged over dp (the reference's mean over data shards); the
    rest is reduced as ``ParallelRun`` documents."""
    from tests.test_parallel_moe import as_param_grad, reduce_grad

    for what, (actual, expected) in run.forward_backward().items():
        check(actual, expected, what)
    ref_params = dict(run.ref.named_parameters())
    for name, param in run.model.named_parameters():
        if not name.startswith(("router.", "shared_experts.")):
            param.grad = as_param_grad(param, reduce_grad(name, param, run.meshes))
        check(full(param.grad), ref_params[name].grad, f"{name}.grad")
    run.opt.step()
    run.opt_ref.step()
    run.opt.zero_grad()
    run.opt_ref.zero_grad()


if __name__ == "__main__":
    run_tests()
