"""Note [Caches hold no tensors] and Note [Fast-step caches]: after a fused step, deleting the
optimizer and its params leaves nothing of them in dtensor_moe's optimizer caches."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import TestCase, run_tests

import dtensor_moe  # noqa: F401  (registers the handlers)
from dtensor_moe import _compat
from dtensor_moe.optim import fast_step
from tests._optim_cases import fast_paths


class OptimizerCachesTest(TestCase):
    def setUp(self):
        super().setUp()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.addCleanup(dist.destroy_process_group)

    def _step_and_watch(self) -> list:
        """Step fused optimizers over DTensor params; weak references to what they touched."""
        mesh = init_device_mesh("cpu", (1,))
        params = [distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(3)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        for _ in range(2):
            opt.step()
        with torch.no_grad():  # the fast entry and the handler, outside torch.optim
            torch._fused_sgd_(params, [p.grad for p in params], [], weight_decay=0.0,
                              momentum=0.0, lr=0.1, dampening=0.0, nesterov=False,
                              maximize=False, is_first_step=True)
        state = opt.state[params[0]]
        watched = [opt, params[0], params[0]._spec, params[0].grad._spec, state["exp_avg"],
                   state["exp_avg"]._spec, state["step"], params[0]._local_tensor]
        sizes = (len(_compat._ALIGNED), len(fast_step._GROUP_KEYS))
        return [weakref.ref(o) for o in watched], sizes

    def test_deleted_optimizer_and_params_are_not_kept(self):
        for enabled in (True, False):
            with fast_paths(enabled):
                refs, sizes = self._step_and_watch()
                self.assertGreater(sizes[0], 0)  # the caches were in use ...
                if enabled:
                    self.assertGreater(min(sizes), 0)
                _compat.clear_sharding_prop_cache()  # torch's own cache holds output specs
                gc.collect()
                self.assertEqual([r() is None for r in refs], [True] * len(refs))
                # ... and their entries died with the tensors (no need to wait for the bound)
                self.assertEqual(
                    (len(_compat._ALIGNED), len(fast_step._GROUP_KEYS)),
                    (0, 0),
                )

    def test_optimizer_kept_alive_by_nothing_of_ours(self):
        # A param that refers back to its optimizer (a user's bookkeeping, a hook closure) made
        # a module-level cache holding the params keep the optimizer alive for good. The
        # fast-step verdict now lives on the optimizer itself.
        for enabled in (True, False):
            with fast_paths(enabled):
                mesh = init_device_mesh("cpu", (1,))
                params = [distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])]
                params[0].grad = torch.ones_like(params[0])
                opt = torch.optim.AdamW(params, lr=0.1, fused=True)
                opt.step()
                params[0].owner = opt  # a cycle through the param
                ref = weakref.ref(opt)
                del opt, params
                _compat.clear_sharding_prop_cache()
                gc.collect()
                self.assertIsNone(ref(), f"fast paths {enabled}: the optimizer was kept alive")

    def test_clear_functions_empty_the_caches(self):
        mesh = init_device_mesh("cpu", (1,))
        params = [distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(2)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.Adam(params, lr=0.1, fused=True)
        opt.step()
        self.assertTrue(fast_step.fast_step_applies(opt))
        self.assertGreater(len(_compat._ALIGNED), 0)
        _compat.clear_aligned_caches()
        fast_step.clear_caches()
        self.assertEqual(
            (len(_compat._ALIGNED), len(fast_step._GROUP_KEYS)),
            (0, 0),
        )
        opt.step()  # and they refill
        self.assertGreater(len(_compat._ALIGNED), 0)


if __name__ == "__main__":
    run_tests()
