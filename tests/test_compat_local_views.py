"""``_compat.local_views``: the cheaper ``to_local(grad_placements=...)`` the experts use."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import _compat
from tests._dist import DistTestBase


def _params(mesh):
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(0), Replicate()])),
        torch.nn.Parameter(distribute_tensor(torch.randn(4, 8, 6), mesh, [Shard(0), Shard(2)])),
    ]


def _grad_placements(w: DTensor) -> tuple:
    return tuple(Partial() if p.is_replicate() else p for p in w.placements)


class LocalViewsTest(DistTestBase):
    @with_comms
    def test_matches_to_local_with_grad_placements(self):
        mesh = init_device_mesh("cpu", (2, 2))
        fast, ref = _params(mesh), _params(mesh)
        torch.manual_seed(1 + self.rank)
        scale = [torch.randn_like(w.to_local()) for w in fast]
        with CommDebugMode() as comms:
            for _ in range(2):  # the second call takes the cached gradient specs
                for w in fast:
                    w.grad = None
                views = _compat.local_views(tuple(fast), tuple(map(_grad_placements, fast)))
                sum((v * s).sum() for v, s in zip(views, scale)).backward()
        self.assertEqual(comms.get_total_counts(), 0)
        for w, s in zip(ref, scale):
            (w.to_local(grad_placements=list(_grad_placements(w))) * s).sum().backward()
        for w_fast, w_ref in zip(fast, ref):
            self.assertIsInstance(w_fast.grad, DTensor)
            self.assertEqual(w_fast.grad.placements, w_ref.grad.placements)
            self.assertEqual(w_fast.grad.stride(), w_ref.grad.stride())
            self.assertEqual(w_fast.grad.to_local(), w_ref.grad.to_local(), atol=0, rtol=0)
            # Partial on the replicated dim: the reduced gradient sums the ranks' partials.
            self.assertEqual(w_fast.grad.full_tensor(), w_ref.grad.full_tensor())

    @with_comms
    def test_gradient_spec_cache_stays_bounded(self):
        mesh = init_device_mesh("cpu", (4,))
        _compat._GRAD_SPECS.clear()
        for n in range(300):  # a new input shape at every forward
            w = DTensor.from_local(torch.zeros(n + 1), mesh, [Shard(0)], run_check=False)
            (view,) = _compat.local_views((w.requires_grad_(),), ((Shard(0),),))
            self.assertEqual(view.shape, (n + 1,))
            # the previous forward's spec died with its DTensor, and its entry with it
            self.assertLessEqual(len(_compat._GRAD_SPECS), 2)
        self.assertGreater(len(_compat._GRAD_SPECS), 0)

    @with_comms
    def test_non_contiguous_local_falls_back_to_to_local(self):
        mesh = init_device_mesh("cpu", (4,))
        local = torch.randn(6, 5).t()  # a transposed, non-contiguous local shard
        w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False).requires_grad_()
        (view,) = _compat.local_views((w,), ((Shard(0),),))
        self.assertFalse(view.is_contiguous())
        view.sum().backward()
        self.assertEqual(w.grad.placements, (Shard(0),))
        self.assertEqual(w.grad.to_local(), torch.ones(5, 6), atol=0, rtol=0)
