"""The example scripts under ``docs/examples`` run on a clean checkout and check themselves."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_fused_adamw_two_meshes_example():
    # Four gloo processes; the script asserts its own parity with a single-device AdamW.
    proc = subprocess.run(
        [sys.executable, "docs/examples/fused_adamw_two_meshes.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "stepped fused AdamW over 3 params on 3 meshes" in proc.stdout, proc.stdout
    assert "max abs difference vs single-device AdamW after 3 steps:" in proc.stdout, proc.stdout
