"""Note [Fast step]: the wrapped ``step()`` of Adam, AdamW, SGD and Adagrad.

It must change nothing but speed: bit-identical results with and without it, no collective,
torch's own ``step`` for anything that is not DTensor/plain params, and the step hooks and
closures keep working. The aligned-slot cache (Note [Aligned-slot cache]) is checked here too.
"""

from __future__ import annotations

import inspect
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe
from dtensor_moe import _compat
from dtensor_moe.optim import fast_step
from dtensor_moe.optim.fast_step import FAST_STEP_CLASSES, fast_step_applies
from tests._dist import DistTestBase
from tests._optim_cases import fast_paths, plain_copies


class RecordingTensor(torch.Tensor):
    """A subclass with a real ``__torch_function__`` that counts the calls it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        RecordingTensor.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _recording_init_group(opt, seen: list):
    """Record, at every ``_init_group``, whether subclass ``__torch_function__`` is enabled."""
    original = opt._init_group

    def init_group(*args, **kwargs):
        seen.append(torch._C._is_torch_function_enabled())
        return original(*args, **kwargs)

    opt._init_group = init_group


class FastStepInstallTest(TestCase):
    def test_one_pre_hook_arms_the_body_for_one_call(self):
        from torch.optim.optimizer import _global_optimizer_pre_hooks

        def ours():
            return [h for h in _global_optimizer_pre_hooks.values()
                    if h is fast_step._arm_fast_step]

        bodies = {cls: _compat.optimizer_step_body_cell(cls).cell_contents
                  for cls in FAST_STEP_CLASSES}
        for cls, body in bodies.items():  # at rest the cells hold torch's own bodies
            self.assertFalse(hasattr(body, "_dtensor_moe_fast_step"), cls)
            self.assertIs(body, inspect.unwrap(cls.step))
        steps = {cls: cls.step for cls in FAST_STEP_CLASSES}
        self.assertEqual(len(ours()), 1)
        dtensor_moe.register_strategies()  # idempotent: no second hook, no wrapper
        self.assertEqual(len(ours()), 1)
        self.assertEqual(steps, {cls: cls.step for cls in FAST_STEP_CLASSES})
        # armed by hand (as the hook does for a DTensor optimizer), a step that raises in its
        # body still leaves torch's body in the cell: the wrapper disarms first thing
        sgd_cell = _compat.optimizer_step_body_cell(torch.optim.SGD)
        cell, armed = next(w for c, _, w in fast_step._body_cells() if c is sgd_cell)
        cell.cell_contents = armed
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        opt = torch.optim.SGD([p], lr=0.1)

        def boom(*args, **kwargs):
            raise RuntimeError("raised inside the step body")

        opt._init_group = boom
        with self.assertRaisesRegex(RuntimeError, "raised inside the step body"):
            opt.step()
        self.assertIs(cell.cell_contents, bodies[torch.optim.SGD])

    def test_plain_params_take_torchs_step(self):
        p = torch.nn.Parameter(torch.randn(4, 4))
        p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        self.assertFalse(fast_step_applies(opt))
        seen: list[bool] = []
        _recording_init_group(opt, seen)
        opt.step()
        self.assertEqual(seen, [True])

    def test_other_subclass_keeps_its_torch_function(self):
        p = RecordingTensor._make_subclass(RecordingTensor, torch.randn(4), require_grad=True)
        p.grad = torch.ones(4)
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        self.assertFalse(fast_step_applies(opt))
        RecordingTensor.calls = 0
        opt.step()
        self.assertGreater(RecordingTensor.calls, 0)


class FastStepDistTest(DistTestBase):
    def _params(self):
        world = init_device_mesh("cpu", (4,))
        mesh2d = init_device_mesh("cpu", (2, 2))
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(7, 6, generator=gen) for _ in range(4)]
        params = [
            distribute_tensor(f, world, [Shard(0)]) if i % 2 == 0
            else distribute_tensor(f, mesh2d, [Shard(0), Shard(1)])
            for i, f in enumerate(fulls)
        ]
        params = [torch.nn.Parameter(p) for p in params]
        for i, p in enumerate(params):
            p.grad = distribute_tensor(
                torch.full(p.shape, 0.1 * (i + 1)), p.device_mesh, p.placements
            )
        return params

    @with_comms
    def test_fast_step_is_bit_identical_and_communication_free(self):
        # Three runs of each optimizer: DTensor params with the fast paths on, the same with
        # them off, and torch's own optimizer on plain copies of this rank's local shards with
        # the fast paths off, which runs no code of dtensor_moe at all (the reference).
        for make in (
            lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True, amsgrad=True),
            lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.1), fused=True),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=True),
            lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1, fused=True),  # no momentum
            lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, fused=True),
            lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
        ):
            results = {}
            for enabled in (True, False):
                with fast_paths(enabled):
                    params = self._params()
                    opt = make(params)
                    self.assertEqual(fast_step_applies(opt), True)
                    seen: list[bool] = []
                    _recording_init_group(opt, seen)
                    with CommDebugMode() as comm:
                        for _ in range(3):
                            opt.step()
                    self.assertEqual(comm.get_total_counts(), 0)
                    # the fast region was entered exactly when the fast paths are on
                    self.assertEqual(seen, [not enabled] * 3)
                    results[enabled] = [p.to_local() for p in params]
            with fast_paths(False):
                ref_params = plain_copies(self._params())
                ref = make(ref_params)
                for _ in range(3):
                    ref.step()
            for a, b, r in zip(results[True], results[False], ref_params):
                self.assertEqual(a, r.detach(), atol=0, rtol=0)
                self.assertEqual(b, r.detach(), atol=0, rtol=0)

    @with_comms
    def test_fused_kernel_gets_local_tensors_in_a_fast_step(self):
        # Note [Local grouping]: aligned lists reach the kernel as plain local tensors; with a
        # closure (torch's own step) the kernel is reached with DTensors, through the handler.
        params = self._params()
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        seen: list[set] = []
        kernel = torch._fused_adamw_

        def recording_kernel(*args, **kwargs):
            seen.append({type(t) for t in args[0]})
            return kernel(*args, **kwargs)

        torch._fused_adamw_ = recording_kernel
        try:
            opt.step()
            opt.step(closure=lambda: None)
            # a grad with other placements on its param's mesh: the handler redistributes it
            params[0].grad = params[0].grad.redistribute(params[0].device_mesh, [Replicate()])
            opt.step()
        finally:
            torch._fused_adamw_ = kernel
        self.assertEqual(seen, [{torch.Tensor}, {DTensor}, {DTensor}])
        self.assertEqual(params[0].grad.placements, (Replicate(),))

    @with_comms
    def test_local_grouping_matches_torchs_grouping_of_the_locals(self):
        params = self._params()
        grads = [p.grad for p in params]
        states = [torch.zeros_like(p) for p in params]
        steps = [torch.tensor(float(i)) for i in range(len(params))]
        lists = [params, grads, states, states, [], steps]  # fused Adam's layout
        local = [[_compat.local_tensor(t) if isinstance(t, DTensor) else t for t in ts] for ts in lists]
        grouping = torch.optim.Optimizer._group_tensors_by_device_and_dtype
        torchs = grouping.__wrapped__
        fast_step._STATE.local_grouping = True
        fast_step._STATE.steps_list = (5, 6)  # as a fused Adam step sets them
        try:
            for with_indices in (False, True):
                got = grouping(lists, with_indices=with_indices)
                want = torchs(local, with_indices)
                self.assertEqual(list(got), list(want))
                for key in want:
                    self.assertEqual(got[key][1], want[key][1])
                    for got_list, want_list in zip(got[key][0], want[key][0]):
                        self.assertTrue(all(map(lambda a, b: a is b, got_list, want_list)))
            # SGD without momentum: an all-None list passes through
            got = grouping([params, grads, [None] * len(params)])
            self.assertEqual(next(iter(got.values()))[0][2], [None] * len(params))
            # A grad of another dtype is not aligned: torch's grouping gets the DTensors, and
            # the fused kernel's DTensor handler then sees the slot, as without dtensor_moe.
            for dtype in (torch.bfloat16, torch.float64):
                bad = [g.to(dtype) if i == 1 else g for i, g in enumerate(grads)]
                got = grouping([params, bad, states, states, [], steps])
                self.assertIs(next(iter(got.values()))[0][1][1], bad[1])
            # Local tensors on two devices under one mesh (FSDP2's CPUOffloadPolicy on some
            # modules keeps their shards on the CPU while others sit on the GPU; here the
            # second device is 'meta'): one group per device, as torch's grouping makes them.
            mixed = [DTensor.from_local(torch.empty(7, 6, device="meta"), p.device_mesh,
                                        p.placements, shape=p.shape, stride=p.stride())
                     if i % 2 else p for i, p in enumerate(params)]
            mixed_lists = [mixed, [torch.zeros_like(p) for p in mixed]]
            got = grouping(mixed_lists, with_indices=True)
            want = torchs([[_compat.local_tensor(t) for t in ts] for ts in mixed_lists], True)
            self.assertEqual(sorted(str(k) for k in got), ["(device(type='cpu'), torch.float32)",
                                                          "(device(type='meta'), torch.float32)"])
            self.assertEqual(list(got), list(want))
            for key in want:
                self.assertEqual(got[key][1], want[key][1])
                for got_list, want_list in zip(got[key][0], want[key][0]):
                    self.assertTrue(all(map(lambda a, b: a is b, got_list, want_list)))
            # A list of plain 0-dim tensors anywhere but state_steps is not aligned either
            # (Note [Per-slot rule]): torch's grouping gets the DTensors, the handler raises.
            zero_dim = [torch.tensor(0.0) for _ in params]
            got = grouping([params, grads, zero_dim, states, [], steps])
            self.assertIs(next(iter(got.values()))[0][0][0], params[0])
        finally:
            fast_step._STATE.local_grouping = False
            fast_step._STATE.steps_list = None
        # Outside a fused fast step, torch's grouping is used unchanged (on the DTensors).
        got = grouping(lists)
        self.assertIs(next(iter(got.values()))[0][0][0], params[0])

    @with_comms
    def test_hooks_closure_and_param_changes(self):
        params = self._params()
        opt = torch.optim.AdamW(params[:2], lr=0.1, fused=True)
        calls: list[str] = []
        opt.register_step_pre_hook(lambda *_: calls.append("pre"))
        opt.register_step_post_hook(lambda *_: calls.append("post"))
        seen: list[bool] = []
        _recording_init_group(opt, seen)
        opt.step()
        self.assertEqual(calls, ["pre", "post"])
        loss = opt.step(closure=lambda: torch.tensor(1.5))  # a closure takes torch's own path
        self.assertEqual(loss, torch.tensor(1.5))
        self.assertEqual(seen, [False, True])
        # A new param group with a subclass param changes the verdict at once.
        extra = RecordingTensor._make_subclass(RecordingTensor, torch.randn(3), require_grad=True)
        extra.grad = torch.ones(3)
        opt.add_param_group({"params": [extra]})
        self.assertFalse(fast_step_applies(opt))
        opt.param_groups.pop()
        self.assertTrue(fast_step_applies(opt))

    @with_comms
    def test_aligned_cache_adopts_equal_new_specs(self):
        first = self._params()
        second = [  # the same layouts, new DTensorSpec objects
            DTensor.from_local(
                p.to_local().clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            for p in first
        ]
        for p, q in zip(first, second):
            self.assertIsNot(p._spec, q._spec)
            self.assertEqual(p._spec, q._spec)
        key = "test-canonical"
        a = _compat.dtensor_specs(first, canonical_key=key)
        self.assertIs(_compat.dtensor_specs(first, canonical_key=key), a)
        # Equal specs of other tensors are adopted, not matched against the old objects forever.
        b = _compat.dtensor_specs(second, canonical_key=key)
        self.assertIsNot(b, a)
        self.assertTrue(all(x is y._spec for x, y in zip(b, second)))
        self.assertIs(_compat.dtensor_specs(second, canonical_key=key), b)
        self.assertIsNone(_compat.dtensor_specs([first[0], torch.zeros(2)]))
        self.assertIsInstance(first[0], DTensor)


if __name__ == "__main__":
    run_tests()
