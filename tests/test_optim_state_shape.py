"""Note [Per-slot rule]: a state whose global shape differs from its param's raises a ValueError
naming the slot, whether the op is called as ``torch.ops.aten``, through torch's Python binding
or from ``optimizer.step()``. It must never reach the kernel (a badly resharded checkpoint once
aborted the process with heap corruption there)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe  # noqa: F401  (registers the handlers)
from tests._dist import DistTestBase

_MSG = (
    r"slot 1 of 'exp_avg_sqs' does not follow param 1: its shape \(12, 4\) differs from the "
    r"param's \(8, 4\)"
)


class StateShapeTest(DistTestBase):
    def _setup(self):
        mesh = init_device_mesh("cpu", (4,))
        gen = torch.Generator().manual_seed(0)
        params = [distribute_tensor(torch.randn(8, 4, generator=gen), mesh, [Shard(0)])
                  for _ in range(3)]
        for p in params:
            p.grad = torch.ones_like(p)
        # same mesh, placements and dtype; another global shape (a badly resharded checkpoint)
        bad = distribute_tensor(torch.ones(12, 4), mesh, [Shard(0)])
        return params, bad

    @with_comms
    def test_state_of_another_shape_raises_on_every_path(self):
        params, bad = self._setup()
        grads = [p.grad for p in params]
        states = [[torch.zeros_like(p) for p in params] for _ in range(3)]
        states[1][1] = bad
        steps = [torch.tensor(1.0) for _ in params]
        kw = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
                  maximize=False)
        args = (params, grads, *states, steps)
        paths = {
            "aten op": lambda: torch.ops.aten._fused_adam_.default(*args, **kw),
            "torch binding": lambda: torch._fused_adam_(*args, **kw),
        }
        for name, call in paths.items():
            for grad_mode in (False, True):
                with torch.set_grad_enabled(grad_mode), CommDebugMode() as comm:
                    with self.assertRaisesRegex(ValueError, _MSG, msg=f"{name}, {grad_mode}"):
                        call()
                self.assertEqual(comm.get_total_counts(), 0)

    @with_comms
    def test_zero_dim_state_outside_state_steps_raises(self):
        # A 0-dim tensor is fine in state_steps only; as exp_avg_sq (plain or a Replicate
        # DTensor) the kernel would read past it (measured: the process aborted).
        msg = (r"slot 1 of 'exp_avg_sqs' does not follow param 1: its shape \(\) differs from "
               r"the param's \(8, 4\)")
        mesh = init_device_mesh("cpu", (4,))
        scalars = {
            "plain": lambda: torch.tensor(0.0),
            "Replicate DTensor": lambda: distribute_tensor(torch.tensor(0.0), mesh, [Replicate()]),
        }
        for name, make in scalars.items():
            params, _ = self._setup()
            opt = torch.optim.Adam(params, lr=0.1, fused=True)
            opt.step()
            opt.state[params[1]]["exp_avg_sq"] = make()
            with CommDebugMode() as comm, self.assertRaisesRegex(ValueError, msg, msg=name):
                opt.step()
            self.assertEqual(comm.get_total_counts(), 0)
            # a whole list of plain 0-dim states (every exp_avg_sq) is no step list
            for p in params:
                opt.state[p]["exp_avg_sq"] = torch.tensor(0.0)
            with self.assertRaisesRegex(ValueError, r"'exp_avg_sqs' does not follow"):
                opt.step()
        dist.barrier()

    @with_comms
    def test_optimizer_step_with_a_bad_state_raises(self):
        params, bad = self._setup()
        opt = torch.optim.Adam(params, lr=0.1, fused=True)
        opt.step()  # creates the state
        before = [p.to_local().clone() for p in params]
        opt.state[params[1]]["exp_avg_sq"] = bad
        for _ in range(2):  # and again: nothing of the good steps lets it through
            with self.assertRaisesRegex(ValueError, _MSG):
                opt.step()
        for p, b in zip(params, before):  # nothing was stepped
            self.assertEqual(p.to_local(), b, atol=0, rtol=0)
        dist.barrier()  # every rank raised the same way; nothing hangs


if __name__ == "__main__":
    run_tests()
