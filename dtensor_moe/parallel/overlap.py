"""Forward/backward overlap of two micro-batches under ``ScheduleDualPipeV``: while one
micro-batch's expert-parallel exchange travels, the other one computes.

Note [F/B overlap]
~~~~~~~~~~~~~~~~~~
``ScheduleDualPipeV`` pairs, in its steady state, the forward of one micro-batch on one stage
with the full backward of another micro-batch on the rank's other stage: an ``OVERLAP_F_B``
action whose two sub-actions torch runs one after the other. :func:`overlap_f_b` registers a
custom function for that action that runs them as two sides taking turns:

* the forward on the calling thread, the backward on a worker thread (a daemon thread that
  stays for the next pair);
* only the side that holds the turn runs; the other waits;
* the turn passes at every expert-parallel exchange launch (the hook of
  ``exchange.set_after_launch``, right after the all-to-all is issued, forward and backward):
  the side that just launched an exchange hands over, and the other side computes while the
  rows travel, up to its own next launch, then hands back;
* a side that has finished hands the turn over for good; the other then runs to its end
  without stopping.

Each sub-action is run by the schedule's own per-action function (``_perform_action`` of the
running step, reached through ``_compat.running_perform_action``): loss, the hand-over between
the two stages of a rank and the gradient bookkeeping are torch's. Before the turns start, both
sub-actions' inputs from the other pp ranks (activations, output gradients) are waited for
(``_compat.wait_stage_input``): a side that waited for its input while holding the turn would
hold up the other side's compute. Neither input depends on the other sub-action: the schedule
sends a pair's outputs only after both sub-actions.

Why the collectives still match: the two ranks of an expert-parallel group hold the same
stages and run the same action list, so each side issues the same collectives (count
exchanges, row exchanges, DTensor collectives) in the same order on both, and the turn passes
at the same points, after the same launches. The interleaved sequence is therefore the same on
every rank of the group, and the number of collectives is that of the plain schedule.

Thread-local state: the worker runs the backward with the caller's grad mode, autocast state
and current accelerator stream. Other thread-local state (a ``TorchDispatchMode`` such as
``CommDebugMode``, profiler scopes) covers the forward side only.

Errors: an exception on either side stops the other at its next launch (or before it starts)
and is raised by the custom function, hence by ``schedule.step``, once both sides have
stopped. A side blocked in a collective whose peer never issues it stops only when the
collective does (as without overlap).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from dtensor_moe import _compat
from dtensor_moe.routed import exchange
from dtensor_moe.parallel.stages import check_schedule

# torch.distributed.pipelining is imported where it is used, not with the package: a process
# that never builds a schedule does not load it (and _compat.in_pipeline_stage_forward then
# returns at once)

__all__ = ["overlap_f_b"]


def overlap_f_b(schedule: Any) -> Any:
    """Run each ``OVERLAP_F_B`` action of ``schedule`` as its forward and backward taking turns
    at every expert-parallel exchange (Note [F/B overlap]); returns ``schedule``.

    Call it on every rank after building the schedule (for example ``ScheduleDualPipeV``) and
    before ``schedule.step``. It issues no collective: every rank checks the same action lists
    of every pp rank and raises the same error.

    Raises:
        TypeError: ``schedule`` does not run ``OVERLAP_F_B`` actions (not a multi-stage
            runtime schedule such as ``ScheduleDualPipeV``).
        ValueError: no pp rank's actions hold an ``OVERLAP_F_B`` action, one of them is not
            a forward and a backward sub-action, or a stage holds an FSDP2 module that reshards
            after forward (:func:`~dtensor_moe.parallel.check_schedule`).
        RuntimeError: this torch's schedule runtime has no per-action function to run the
            sub-actions with.
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    if not _compat.is_pipeline_runtime(schedule):
        raise TypeError(
            f"overlap_f_b: {type(schedule).__name__} does not run OVERLAP_F_B actions; use "
            "ScheduleDualPipeV (torch.distributed.pipelining), whose steady state pairs a "
            "forward with a backward"
        )
    orders = schedule.pipeline_order_with_comms or {}
    overlaps = [a for actions in orders.values() for a in actions
                if a is not None and a.computation_type == OVERLAP_F_B]  # fmt: skip
    if not overlaps:
        raise ValueError(
            f"overlap_f_b: {type(schedule).__name__} has no OVERLAP_F_B action on any pp rank, "
            "so there is nothing to overlap; ScheduleDualPipeV pairs forwards with backwards "
            "in its steady state"
        )
    for action in overlaps:
        _sides(action)  # raises on a malformed pair
    check_schedule(schedule)  # Note [FSDP2 under V schedules]
    _check_hand_over(schedule)
    if not _compat.runtime_defines_perform_action():
        raise RuntimeError(
            f"overlap_f_b: torch {torch.__version__}'s pipeline runtime has no per-action "
            "function (_perform_action) to run the sub-actions with; this version of "
            "dtensor_moe supports torch 2.13's"
        )
    schedule.register_custom_function(OVERLAP_F_B, _run_overlapped)
    return schedule


def _check_hand_over(schedule: Any) -> None:
    """Refuse a stage whose experts' exchange does not hand over at its launches (Note
    [Exchange protocol] in ``routed/exchange.py``): the turns would never pass there, and the
    overlap would silently not happen. Every rank checks its own stages; no collective."""
    for stage in _compat.schedule_stages(schedule):
        for name, module in stage.submod.named_modules():
            exchange = getattr(getattr(module, "plan", None), "exchange", None)
            if exchange is not None and not exchange.hands_over_launches:
                raise ValueError(
                    f"overlap_f_b: stage {stage.stage_index}'s experts {name!r} use the "
                    f"{exchange.name!r} exchange, which does not hand over to the other "
                    "micro-batch at its launches (hands_over_launches=False), so nothing would "
                    "overlap; parallelize the experts with exchange='all_to_all'"
                )


def _sides(action: Any) -> tuple[Any, Any, int]:
    """The forward and backward sub-actions of ``action``, and which of the two is listed
    first (0: the forward)."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, FORWARD, FULL_BACKWARD

    subs = tuple(action.sub_actions or ())
    kinds = [a.computation_type for a in subs]
    backward = any(k in (FULL_BACKWARD, BACKWARD_INPUT) for k in kinds)
    if len(subs) == 2 and FORWARD in kinds and backward:
        first = 0 if kinds[0] == FORWARD else 1
        fwd, bwd = (subs[0], subs[1]) if first == 0 else (subs[1], subs[0])
        return fwd, bwd, first
    raise ValueError(
        f"overlap_f_b: the action {action} pairs {[str(a) for a in subs]}; overlap_f_b runs "
        "pairs of one forward and one full or input backward"
    )


def _run_overlapped(action: Any, ctx: Any) -> None:
    """The custom function of ``OVERLAP_F_B``: (action, _PipelineContext) -> None."""
    schedule = ctx.schedule_ref
    perform = _compat.running_perform_action(schedule)
    if perform is None:
        raise RuntimeError(
            f"overlap_f_b: {action} runs outside {type(schedule).__name__}.step (no running "
            "per-action function was found in the caller's frames)"
        )
    fwd, bwd, first = _sides(action)
    # Both inputs from the other pp ranks first: a side that waited for one while holding the
    # turn would hold up the other side's compute (and it no longer depends on it).
    for sub in action.sub_actions:
        _compat.wait_stage_input(schedule, sub)
    run_pair(lambda: perform(fwd), lambda: perform(bwd), first=first)


class _Stopped(Exception):
    """Raised in a side at its next hand-over once the other side has failed."""


class _Turns:
    """Two sides, 0 (the calling thread) and 1 (a worker), of which only the one holding the
    turn runs. ``switch`` is the exchanges' after-launch hook."""

    def __init__(self, first: int) -> None:
        self._cond = threading.Condition()
        self._turn = first
        self._done = [False, False]
        self._failed = False
        self.chained: Callable[[], None] | None = None  # the hook installed before ours

    def switch(self) -> None:
        """Hand the turn to the other side (unless it has finished) and wait for it back."""
        if self.chained is not None:
            self.chained()
        with self._cond:
            side = self._turn
            if self._done[1 - side]:
                return
            self._turn = 1 - side
            self._cond.notify_all()
            self._wait(side)

    def begin(self, side: int) -> None:
        with self._cond:
            self._wait(side)

    def end(self, side: int, failed: bool) -> None:
        with self._cond:
            self._done[side] = True
            self._failed = self._failed or failed
            self._turn = 1 - side
            self._cond.notify_all()

    def _wait(self, side: int) -> None:
        self._cond.wait_for(lambda: self._turn == side or self._failed)
        if self._failed:
            raise _Stopped


def run_pair(side0: Callable[[], None], side1: Callable[[], None], *, first: int = 0) -> None:
    """Run ``side0`` on this thread and ``side1`` on a worker thread, taking turns at every
    exchange launch, ``first`` starting (Note [F/B overlap]). Raises the first exception of
    either side after both have stopped."""
    turns = _Turns(first)
    errors: list[BaseException] = []  # in the order they happened
    run_side1 = _with_thread_state(side1)
    done = threading.Event()

    def job() -> None:
        try:
            _run_side(turns, 1, run_side1, errors)
        finally:
            done.set()

    turns.chained = exchange.set_after_launch(turns.switch)
    worker = _Worker.take()
    try:
        worker.submit(job)
        try:
            _run_side(turns, 0, side0, errors)
        finally:
            done.wait()
        worker.give_back()
    finally:
        exchange.set_after_launch(turns.chained)
    if errors:
        raise errors[0]


def _run_side(turns: _Turns, side: int, fn: Callable[[], None], errors: list) -> None:
    """Run ``fn`` as ``side`` once it has the turn; record its exception, if any, in
    ``errors``. A side stopped because the other failed records nothing."""
    failed = True
    try:
        turns.begin(side)
        fn()
        failed = False
    except _Stopped:
        pass
    except BaseException as e:  # noqa: BLE001 - raised by run_pair once both sides stopped
        errors.append(e)
    finally:
        turns.end(side, failed)


class _Worker:
    """A daemon thread that runs the jobs given to it, one at a time, and waits for more.

    A thread's first torch ops cost more than its later ones (per-thread setup), so the pairs
    reuse idle workers rather than start a thread each. Workers are per process: a forked child
    starts its own (the parent's threads do not exist in it).
    """

    _idle: list[_Worker] = []
    _lock = threading.Lock()
    _pid = os.getpid()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=self._loop, name="dtensor_moe-overlap", daemon=True)
        thread.start()

    @classmethod
    def take(cls) -> _Worker:
        with cls._lock:
            if cls._pid != os.getpid():
                cls._idle.clear()
                cls._pid = os.getpid()
            return cls._idle.pop() if cls._idle else cls()

    def give_back(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._idle.append(self)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            self._jobs.get()()  # a job records its own exceptions


def _with_thread_state(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` wrapped to run, on another thread, under this thread's grad mode, autocast
    state and current accelerator stream."""
    grad = torch.is_grad_enabled()
    device_types = ["cpu"]
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        device_types.append(accelerator.type)
    autocasts = [(d, torch.get_autocast_dtype(d)) for d in device_types
                 if torch.is_autocast_enabled(d)]  # fmt: skip
    stream = torch.accelerator.current_stream() if accelerator is not None else None

    def run() -> None:
        if stream is not None:
            torch.accelerator.set_stream(stream)
        with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
            for device_type, dtype in autocasts:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            fn()

    return run
