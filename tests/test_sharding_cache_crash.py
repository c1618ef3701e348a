"""Torch's C++ sharding-propagation cache and the package (one process, gloo world of 1).

Note [Registration leaves torch's sharding cache alone] (``dtensor_moe/optim/fused.py``) rests
on four facts about torch 2.13, each pinned here, and on one change to the package:

* DTensor calls a handler of its handler table before it looks in the C++ cache, so a handler
  takes over an op whose sharding was cached before (registration needs no clear);
* the cache keys hold their specs, hence their meshes: a key never refers to a freed mesh;
* a clear reaches only the calling thread's cache;
* a clear that runs inside a lookup on the same thread (here from ``DTensorSpec.__eq__``, which
  the lookup calls; in a program, a GC or weakref callback running there) crashes the process;
* so ``register_strategies`` leaves the cache alone: its entries survive a registration, and a
  registration inside a lookup is harmless (with the clear it had, the child dies with SIGSEGV).

The crash runs in a forked child (``multiprocessing`` fork) with glibc's ``M_PERTURB`` set,
so that a read of freed memory fails at once: its exit code is the signal. When a torch
release makes a clear inside a lookup safe, ``test_clear_inside_a_lookup_crashes`` fails and
the Note can be revisited.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing
import signal
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor._redistribute as torch_redistribute
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import dtensor_moe
from dtensor_moe import _compat

aten = torch.ops.aten
LOOKUPS = 50  # lookups with a clear inside; each reads freed memory (20 always crashed)
_M_PERTURB = -6  # glibc's mallopt parameter


def _stats() -> tuple[int, int]:
    """(hits, misses) of this thread's C++ cache since its last clear."""
    return torch._C._get_DTensor_sharding_propagator_cache_stats()


def _dtensor(mesh) -> DTensor:
    return distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_registration_keeps_the_cached_shardings(mesh):
    x = _dtensor(mesh)
    x.narrow(0, 1, 3)  # cached, if it was not
    hits, misses = _stats()
    dtensor_moe.register_strategies()
    x.narrow(0, 1, 3)
    assert _stats() == (hits + 1, misses)  # a hit: the entry is still there


def test_a_handler_takes_over_a_cached_op(mesh):
    a, b = _dtensor(mesh), _dtensor(mesh)
    torch.mul(a, b)
    torch.mul(a, b)
    hits, _ = _stats()
    assert hits > 0  # aten.mul.Tensor on these specs is in the cache
    calls = []

    def handler(op, args, kwargs):
        calls.append(op)
        return args[0]

    handlers = _compat.custom_op_handlers()
    assert aten.mul.Tensor not in handlers
    handlers[aten.mul.Tensor] = handler
    try:
        assert torch.mul(a, b) is a  # no clear in between
    finally:
        del handlers[aten.mul.Tensor]
    assert calls == [aten.mul.Tensor]


def _clear_python_side_torch_caches() -> None:
    """torch's caches that hold meshes, except the C++ sharding-propagation cache."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch_redistribute._gen_transform_infos.cache_clear()
    torch_redistribute._planner_cache.clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def test_cache_keys_keep_their_mesh_alive(mesh):
    own = init_device_mesh("cpu", (1,), mesh_dim_names=("own",))
    own_ref = weakref.ref(own)
    _dtensor(own).narrow(0, 2, 5)
    del own
    _clear_python_side_torch_caches()
    gc.collect()
    assert own_ref() is not None  # held by the C++ cache's key
    _compat.clear_sharding_prop_cache()
    _clear_python_side_torch_caches()
    gc.collect()
    assert own_ref() is None


def test_a_clear_reaches_only_its_own_thread(mesh):
    x = _dtensor(mesh)
    x.narrow(0, 1, 3)
    x.narrow(0, 1, 3)
    hits, misses = _stats()
    other = threading.Thread(target=_compat.clear_sharding_prop_cache)
    other.start()
    other.join()
    x.narrow(0, 1, 3)
    assert _stats() == (hits + 1, misses)
    _compat.clear_sharding_prop_cache()
    assert _stats() == (0, 0)


def _lookups_with(inside) -> None:
    """In a forked child: ``LOOKUPS`` cache lookups, each calling ``inside()`` once from the
    key comparison (``DTensorSpec.__eq__``); exits 0 if the process survives."""
    faulthandler.disable()  # the expected crash needs no traceback in the test log
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc
    if mallopt is not None:
        mallopt(_M_PERTURB, 0xA5)  # freed memory is overwritten: a read of it fails at once
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    first = _dtensor(mesh)
    compare, armed = DTensorSpec.__eq__, [False]

    def eq(self, other):
        if armed[0]:
            armed[0] = False
            inside()
        return compare(self, other)

    DTensorSpec.__eq__ = eq
    for _ in range(LOOKUPS):
        first.narrow(0, 0, 0)  # an entry (again) whose spec equals the next lookup's
        x = _dtensor(mesh)  # a new spec object, equal to the cached ones: compared in Python
        armed[0] = True
        x.narrow(0, 1, 3)
        x.narrow(0, 1, 3)


def _exit_code(inside) -> int:
    child = multiprocessing.get_context("fork").Process(target=_lookups_with, args=(inside,))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the child did not finish in 120 s")
    return child.exitcode


def test_clear_inside_a_lookup_crashes():
    assert _exit_code(_compat.clear_sharding_prop_cache) == -signal.SIGSEGV


def test_registration_inside_a_lookup_is_harmless():
    assert _exit_code(dtensor_moe.register_strategies) == 0
