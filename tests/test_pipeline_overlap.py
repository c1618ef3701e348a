"""``overlap_f_b``: ``ScheduleDualPipeV``'s forward/backward pairs taking turns at every
expert-parallel exchange (Note [F/B overlap] in ``dtensor_moe/parallel/overlap.py``).

On 4 gloo ranks (pp2 x dp2 with EP2 inside each stage, the model and reference of
``tests/test_pipeline_schedule.py``): the overlapped schedule matches one process exactly as the
plain one does (3 steps of fused AdamW: each step's losses and param grads, then the params and
every router's counters), a backward side ran while
a forward exchange travelled (never under the plain schedule), and the all-to-alls are as many
as under the plain schedule, issued in the same order on both ranks of each EP group. In one
process: the turn-taking itself (order, errors of either side, thread-local state) and the
errors of ``overlap_f_b``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
    _PipelineScheduleRuntime,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import _compat
from dtensor_moe.parallel import overlap_f_b
from dtensor_moe.routed import all_to_all as pairs, exchange
from dtensor_moe.parallel.overlap import run_pair
from tests._dist import DistTestBase
from tests import test_pipeline_schedule as schedule_tests  # (its test class would rerun here)


def dualpipe_v_overlapped(stages, n_microbatches, **kwargs):
    """``ScheduleDualPipeV`` with :func:`overlap_f_b` (the schedule factory ``_check`` takes)."""
    return overlap_f_b(ScheduleDualPipeV(stages, n_microbatches, **kwargs))


@contextmanager
def recorded_exchanges(events: list, a2a: list):
    """Record every exchange start and wait as ``(kind, id(exchange), side)``, side ``"B"``
    inside autograd's backward, and the split sizes of every ``all_to_all_single``."""
    launch, wait, all_to_all = pairs._launch, pairs.Exchange.wait, dist.all_to_all_single

    def side() -> str:
        return "B" if _compat.in_backward_pass() else "F"

    def recording_launch(ex, *args):
        events.append(("start", id(ex), side()))
        launch(ex, *args)

    def recording_wait(ex):
        events.append(("wait", id(ex), side()))
        wait(ex)

    def recording_all_to_all(out, inp, out_splits=None, in_splits=None, **kwargs):
        a2a.append((out_splits, in_splits))
        return all_to_all(out, inp, out_splits, in_splits, **kwargs)

    pairs._launch, pairs.Exchange.wait = recording_launch, recording_wait
    dist.all_to_all_single = recording_all_to_all
    try:
        yield
    finally:
        pairs._launch, pairs.Exchange.wait = launch, wait
        dist.all_to_all_single = all_to_all


def backward_inside_forward_exchange(events: list) -> int:
    """How many forward exchanges saw a backward exchange start between their start and wait."""
    started: dict[int, int] = {}
    found = 0
    for i, (kind, key, side) in enumerate(events):
        if side != "F":
            continue
        if kind == "start":
            started[key] = i
        elif key in started:
            found += any(s == "B" and k == "start" for k, _, s in events[started.pop(key) : i])
    return found


class PipelineOverlapTest(DistTestBase):
    @with_comms
    def test_dualpipe_v_overlap(self):
        traces = {}
        # the plain schedule for one step (the control), the overlapped one for 3: its parity
        # with one process exactly as test_dualpipe_v checks it
        for schedule, steps in ((ScheduleDualPipeV, 1), (dualpipe_v_overlapped, 3)):
            events, a2a = [], []
            with recorded_exchanges(events, a2a):
                schedule_tests.check_training(self, schedule, "v", steps=steps)
            traces[schedule.__name__] = events, a2a
        plain_events, plain_a2a = traces["ScheduleDualPipeV"]
        events, a2a = traces["dualpipe_v_overlapped"]
        # a backward computed (and launched its exchange) while a forward exchange travelled
        self.assertEqual(backward_inside_forward_exchange(plain_events), 0)
        self.assertGreater(backward_inside_forward_exchange(events), 0)
        # the same collectives, in an order that the two ranks of the EP group agree on
        self.assertEqual(len(a2a), 3 * len(plain_a2a))  # as many per step
        self.assertEqual(len(events), 3 * len(plain_events))
        self.assertGreater(len(a2a), 0)
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the EP groups (stages)
        ranks = [None] * 2
        dist.all_gather_object(ranks, a2a, group=groups[self.rank // 2])
        me, other = self.rank % 2, 1 - self.rank % 2
        for mine, theirs in zip(ranks[me], ranks[other]):
            if mine[0] is not None:  # variable splits: what I receive from them, they send
                self.assertEqual(mine[0][other], theirs[1][me])


# -- one process: the turn-taking and the errors --


def launch() -> None:
    """What an exchange launch does after issuing its all-to-all: call the installed hook."""
    hook = exchange.set_after_launch(None)
    exchange.set_after_launch(hook)
    if hook is not None:
        hook()


def test_sides_take_turns_at_every_launch():
    order = []

    def side(name: str, launches: int):
        def run():
            for i in range(launches):
                order.append(f"{name}{i}")
                launch()
            order.append(f"{name} end")

        return run

    run_pair(side("f", 3), side("b", 1))
    assert order == ["f0", "b0", "f1", "b end", "f2", "f end"]
    order.clear()
    run_pair(side("f", 1), side("b", 2), first=1)
    assert order == ["b0", "f0", "b1", "f end", "b end"]
    assert exchange.set_after_launch(None) is None  # the hook is restored


def test_chains_the_previous_hook_and_restores_it():
    calls = []
    previous = exchange.set_after_launch(lambda: calls.append(threading.current_thread()))
    try:
        run_pair(launch, launch)
        assert len(calls) == 2 and calls[0] is not calls[1]
        assert exchange.set_after_launch(None) is not None
    finally:
        exchange.set_after_launch(previous)


@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_on_either_side_stops_the_other_and_is_raised(failing):
    ran = []

    def side(i: int):
        def run():
            launch()
            if i == failing:
                raise ValueError(f"side {i}")
            launch()
            ran.append(i)  # not reached: the other side failed at its launch

        return run

    with pytest.raises(ValueError, match=f"side {failing}"):
        run_pair(side(0), side(1))
    assert ran == []
    assert exchange.set_after_launch(None) is None


def test_pairs_reuse_one_worker_thread():
    threads = []

    def record():
        threads.append(threading.current_thread())

    for _ in range(3):
        run_pair(lambda: None, record)
    assert threads[0] is not threading.current_thread()
    assert threads == threads[:1] * 3


def test_worker_runs_with_the_callers_grad_mode_and_autocast():
    seen = []

    def record():
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run_pair(record, record)
    run_pair(record, record)
    assert seen == [(False, True), (False, True), (True, False), (True, False)]


def _runtime_with(actions: list) -> _PipelineScheduleRuntime:
    schedule = object.__new__(ScheduleDualPipeV)
    schedule.pipeline_order_with_comms = {0: actions, 1: []}
    return schedule


def test_overlap_f_b_errors():
    with pytest.raises(TypeError, match="object does not run OVERLAP_F_B actions"):
        overlap_f_b(object())
    with pytest.raises(ValueError, match="no OVERLAP_F_B action on any pp rank"):
        overlap_f_b(_runtime_with([_Action(0, FORWARD, 0), _Action(0, FULL_BACKWARD, 0)]))
    pair = (_Action(0, FORWARD, 1), _Action(3, FORWARD, 0))
    with pytest.raises(ValueError, match="pairs of one forward and one full or input backward"):
        overlap_f_b(_runtime_with([_Action(-1, OVERLAP_F_B, None, pair)]))


if __name__ == "__main__":
    run_tests()
