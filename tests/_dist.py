"""The base class of our multi-process tests: real gloo process groups on CPU.

``DTensorTestBase`` spawns fresh interpreters for every test, which costs several seconds of
imports per test on a 2-core machine. We fork instead: the children inherit the imported
modules and start in well under a second. Each test still gets its own processes and its own
gloo process group, and runs the same code as under ``torchrun``.

Forking has one catch, a torch 2.13 bug: inductor's C++ compile thread pool
(``AsyncCompile.pool``, an ``lru_cache``d ``ThreadPoolExecutor``) survives the fork, but its
threads do not, so a child whose parent already compiled with inductor queues its kernels on a
pool that never runs them and hangs until the test times out. torch's own after-fork hook resets
the process pool only. :func:`reset_inherited_compile_pool` drops the dead pool in each child;
``tests/test_fork_compile_pool.py`` shows that the workaround is needed.

A rank that dies (a signal, or an exit code other than the test's error and skip codes) leaves
the others waiting in their next collective until the test's timeout (300 s), and torch's
harness then reports a timeout of another rank. :class:`DistTestBase` stops the others as soon
as one dies and fails the test naming the rank and how it died (``tests/test_dist_harness.py``).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading

import torch
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase


def reset_inherited_compile_pool() -> None:
    """In a forked child: forget inductor's thread pool inherited from the parent (its threads
    did not survive the fork), so the next compile starts a live one."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


class DistTestBase(DTensorTestBase):
    """``DTensorTestBase`` on CPU/gloo with forked workers, 1 intra-op thread, world size 4."""

    WORLD_SIZE = 4

    @property
    def world_size(self) -> int:
        return self.WORLD_SIZE

    @property
    def device_type(self) -> str:
        return "cpu"

    @property
    def backend(self) -> str:
        return "gloo"

    def setUp(self) -> None:
        super(DTensorTestBase, self).setUp()  # skip DTensorTestBase's spawn
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, parent_pipe, **kwargs) -> None:
        torch.set_num_threads(1)
        reset_inherited_compile_pool()
        faulthandler.enable(all_threads=True)  # a crash prints each thread's stack to stderr
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)

    def _join_processes(self, fn) -> None:
        self._died: tuple[int, int] | None = None
        joined = threading.Event()
        watcher = threading.Thread(target=self._stop_all_if_one_dies, args=(joined,), daemon=True)
        watcher.start()
        try:
            super()._join_processes(fn)
        finally:
            joined.set()
            watcher.join()

    def _stop_all_if_one_dies(self, joined: threading.Event) -> None:
        expected = {0, MultiProcessTestCase.TEST_ERROR_EXIT_CODE}
        expected |= {skip.exit_code for skip in TEST_SKIPS.values()}
        while not joined.wait(0.2):
            for rank, process in enumerate(self.processes):
                if process.exitcode is not None and process.exitcode not in expected:
                    self._died = (rank, process.exitcode)
                    for other in self.processes:
                        if other.exitcode is None:
                            other.terminate()
                    return

    def _check_return_codes(self, fn, elapsed_time) -> None:
        if self._died is not None:  # set by _join_processes, the only caller
            rank, code = self._died
            how = (f"of signal {signal.Signals(-code).name}" if code < 0
                   else f"with exit code {code}")  # fmt: skip
            raise RuntimeError(
                f"rank {rank} of {self.world_size} died {how} after {elapsed_time:.0f} s; the "
                "other ranks were stopped at once (they would have waited in a collective until "
                "the timeout). A crash prints the rank's stack to stderr (faulthandler)."
            )
        super()._check_return_codes(fn, elapsed_time)
