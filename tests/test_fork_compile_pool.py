"""The forked test ranks need ``reset_inherited_compile_pool`` (see ``tests/_dist.py``).

torch 2.13 resets inductor's compile *process* pool after a fork but not its compile *thread*
pool: a forked child gets the parent's ``ThreadPoolExecutor`` object without its threads, and
a task queued on it never runs. These tests fork a child from a parent whose pool is live and
show that the inherited pool is dead, and that the reset gives the child a working one. When a
torch release fixes the bug, the first test fails and the workaround can go.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch._inductor.async_compile as async_compile
from torch._inductor import config as inductor_config

from tests._dist import reset_inherited_compile_pool


def _probe(queue, reset: bool) -> None:
    try:
        if reset:
            reset_inherited_compile_pool()
        future = async_compile.AsyncCompile.pool().submit(lambda: "ran")
        try:
            queue.put(future.result(timeout=5))
        except FutureTimeout:
            queue.put("hung")
    except BaseException as e:  # report, never hang the parent
        queue.put(f"error: {e!r}")
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def _in_forked_child(reset: bool) -> str:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_probe, args=(queue, reset))
    child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()


@pytest.fixture
def live_parent_pool():
    """The parent's inductor thread pool, created and running, as after an inductor compile."""
    with inductor_config.patch(compile_threads=2):
        async_compile.AsyncCompile.pool.cache_clear()
        assert async_compile.AsyncCompile.pool().submit(lambda: "ran").result(timeout=30) == "ran"
        yield
        async_compile.AsyncCompile.pool().shutdown(wait=True)
        async_compile.AsyncCompile.pool.cache_clear()


def test_forked_child_inherits_a_dead_compile_thread_pool(live_parent_pool):
    assert _in_forked_child(reset=False) == "hung"


def test_reset_gives_the_forked_child_a_live_pool(live_parent_pool):
    assert _in_forked_child(reset=True) == "ran"
