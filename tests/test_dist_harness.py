"""``tests/_dist.py``'s harness: a rank that dies fails the test at once, naming the rank and
the signal, instead of leaving the other ranks in a collective until the 300 s timeout (which
torch's harness reports as a timeout of another rank)."""

from __future__ import annotations

import os
import signal
import time
import unittest

from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from tests._dist import DistTestBase


class _OneRankDies(DistTestBase):
    __test__ = False  # run by the test below, not collected by pytest itself
    WORLD_SIZE = 2

    @with_comms
    def test_rank_one_is_killed(self):
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # rank 0 waits for what rank 1 will never send (gloo notices a dead peer
            time.sleep(0.1)  # in a barrier, but not every wait is one)


def test_a_dead_rank_fails_the_test_at_once_and_is_named():
    result = unittest.TestResult()
    _OneRankDies("test_rank_one_is_killed").run(result)
    assert len(result.errors) == 1 and not result.failures, (result.errors, result.failures)
    message = result.errors[0][1]
    assert "rank 1 of 2 died of signal SIGKILL" in message, message
    assert "timed out" not in message, message
