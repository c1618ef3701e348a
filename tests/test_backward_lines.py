"""The hand-written backward that docs/moe.md states: the count of
``benchmarks/backward_lines.py``, and within the budget of the stages issue (at most half of
the 197 lines the one-node design had by the issue's count)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import dtensor_moe

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _count() -> int:
    script = ROOT / "benchmarks" / "backward_lines.py"
    spec = importlib.util.spec_from_file_location("backward_lines", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sum(module.count(pathlib.Path(dtensor_moe.__file__).parent).values())


def test_docs_state_the_hand_written_backward_lines():
    stated = re.search(r"package total (\d+) lines", (ROOT / "docs" / "moe.md").read_text())
    assert stated is not None, "docs/moe.md no longer states the hand-written backward lines"
    counted = _count()
    assert int(stated[1]) == counted, f"docs/moe.md says {stated[1]}, the script counts {counted}"
    assert counted <= 98, f"{counted} lines of hand-written backward: over the budget of 98"
