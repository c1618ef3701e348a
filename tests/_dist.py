"""The base class of our multi-process tests: real gloo process groups on CPU.

``DTensorTestBase`` spawns fresh interpreters for every test, which costs several seconds of
imports per test on a 2-core machine. We fork instead: the children inherit the imported
modules and start in well under a second. Each test still gets its own processes and its own
gloo process group, and runs the same code as under ``torchrun``.
"""

from __future__ import annotations

import torch
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase


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
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
