"""The example scripts under ``docs/examples`` run on a clean checkout and check themselves."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

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


HF_LAUNCHERS = {
    "python": [],
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"],
}


@pytest.mark.parametrize("launcher", list(HF_LAUNCHERS))
def test_hf_moe_parallel_example(launcher, tmp_path):
    # Four gloo processes, plain or under torchrun; the script checks its own parity with the
    # HF model trained in one process, and its DCP save and HF export. Plain: no --out, so it
    # writes to a temporary folder outside the checkout and says where; torchrun: --out.
    out_flag = ["--out", str(tmp_path / "out")] if launcher == "torchrun" else []
    cmd = [sys.executable, *HF_LAUNCHERS[launcher], "docs/examples/hf_moe_parallel.py", *out_flag]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    where = re.search(r"(?m)^writing the DCP checkpoints and HF exports under (.+)$", proc.stdout)
    out = pathlib.Path(where.group(1)) if where else None
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        assert out is not None and out.is_dir(), proc.stdout
        if out_flag:
            assert out == tmp_path / "out", out
        else:
            assert ROOT not in out.parents and out.name.startswith("hf_moe_parallel_"), out
        for model_type in ("qwen3_moe", "deepseek_v3"):
            assert f"{model_type}: swapped" in proc.stdout, proc.stdout
            steps = re.findall(r"(?m)^  step \d: .* rel diff (\S+)$",
                               proc.stdout.split(f"{model_type}: swapped")[1])
            assert len(steps) >= 5 and all(float(d) <= 1e-5 for d in steps[:5]), proc.stdout
            assert (out / model_type / "dcp" / ".metadata").is_file()
            assert (out / model_type / "hf" / "config.json").is_file()
        assert "OK: every step matched the single-process HF model" in proc.stdout, proc.stdout
    finally:
        if out is not None and not out_flag:
            shutil.rmtree(out, ignore_errors=True)
