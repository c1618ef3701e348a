"""Many ranks in one process: torch's threaded process group, one thread per rank.

``torch.testing._internal.distributed.multi_threaded_pg`` registers a ``"threaded"`` backend
whose collectives move real data between the threads of one process (the world is
thread-local: each thread has its own default group, ranks and sub-groups). The code under
test runs unmodified, collectives included: a collective completes once every rank of its
group has issued it, so ranks that issue different collectives, or sizes that disagree, fail
or hang as they would on real processes (a hang here ends at the timeout).

:func:`run_ranks` runs ``fn(rank)`` on every rank and returns what each returned.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

from dtensor_moe.parallel import mesh as _mesh


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 120.0) -> dict[int, Any]:
    """``fn(rank)`` on ``world`` threads, each rank ``rank`` of a fresh threaded world.

    Returns ``{rank: fn(rank)}``. Raises ``AssertionError`` naming the rank and its traceback
    when ``fn`` raises on a rank (the other ranks are woken and stopped), and naming the ranks
    still running, with their stacks, after ``timeout`` seconds.
    """
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    store = dist.HashStore()

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            if not isinstance(exc, SystemExit):  # SystemExit: stopped after another rank failed
                errors[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    # build_moe_meshes remembers the meshes of live worlds (Note [Mesh memo]); drop the
    # entries of earlier worlds here, once, rather than in every thread at the same time.
    _mesh._live_entry(())
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    threads = [
        threading.Thread(target=worker, args=(r,), name=f"rank {r}", daemon=True)
        for r in range(world)
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
        stacks = "".join(
            f"\nrank {r}:\n" + "".join(traceback.format_stack(sys._current_frames()[t.ident]))
            for r, t in enumerate(threads)
            if t.is_alive() and t.ident in sys._current_frames()
        )
        if stuck:
            ProcessLocalGroup.exception_handle(TimeoutError())
            for thread in threads:
                thread.join(5.0)
    finally:
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world} raised:\n{errors[rank]}")
    if stuck:
        raise AssertionError(f"ranks {stuck} of {world} still running after {timeout} s:{stacks}")
    return results
