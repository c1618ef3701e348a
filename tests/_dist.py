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
"""

from __future__ import annotations

import sys

import torch
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
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
