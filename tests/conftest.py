"""The ``quick`` marker: a subset of the suite that runs in under two minutes on 2 cores.

``python -m pytest -q -m quick tests`` selects it. The subset is decided here, in one place,
rather than by a decorator on each test:

* every single-process test, except those that compile with ``torch.compile``, start
  subprocesses (``torchrun``, the demo, the examples, the benchmark smoke runs, the docs'
  snippets) or build every Hugging Face family;
* a few multi-process tests, one per product half and layout family (:data:`QUICK_DIST`), so
  that the quick run still exercises real gloo collectives: fused optimizers across meshes,
  EP4 parity, a pipeline schedule, grad clipping and the dense TP/SP plan.

The full suite (``python -m pytest -q tests``) runs everything, quick or not.
"""

from __future__ import annotations

import pytest

# Files whose tests start subprocesses or compile: never quick.
SLOW_FILES = frozenset(
    {
        "test_benchmarks_smoke.py",
        "test_demo.py",
        "test_docs_snippets.py",
        "test_examples.py",
        "test_fork_compile_pool.py",
        "test_hf.py",
        "test_moe_compile.py",
        "test_optim_compile.py",
        "test_optim_no_harm.py",
        "test_parallel_compile.py",
        "test_cuda.py",
    }
)

# Multi-process tests that join the quick subset ("file::Class::test").
QUICK_DIST = frozenset(
    {
        "test_fused_optim_dist.py::FusedOptimizerAcrossMeshesTest::test_every_optimizer_matches_single_device",
        "test_parallel_moe.py::ParallelMoEParityTest::test_ep4_dp2ep",
        "test_pipeline_schedule.py::PipelineScheduleTest::test_gpipe",  # (1F1B alone: full matrix)
        "test_clip_grad_norm.py",
        "test_dense_plan.py",
    }
)

_SLOW_WORDS = ("compile", "inductor", "torchrun", "subprocess")


def _is_multiprocess(item: pytest.Item) -> bool:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    cls = getattr(item, "cls", None)
    return cls is not None and issubclass(cls, MultiProcessTestCase)


def _quick(item: pytest.Item) -> bool:
    parts = item.nodeid.split("::")
    file = parts[0].rsplit("/", 1)[-1]
    if file in SLOW_FILES:
        return False
    if _is_multiprocess(item):
        name = "::".join([file, *parts[1:]]).split("[", 1)[0]
        return file in QUICK_DIST or name in QUICK_DIST
    return not any(word in item.name.lower() for word in _SLOW_WORDS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "quick: the quick subset (under 2 minutes on 2 cores); see tests/conftest.py"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _quick(item):
            item.add_marker(pytest.mark.quick)
