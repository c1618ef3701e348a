"""The example scripts under ``docs/examples`` run on a clean checkout and check themselves."""

from __future__ import annotations

import json
import os
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


# CI: the plain launcher; DTENSOR_MOE_FULL_MATRIX=1 adds torchrun (about 20 s), which
# test_demo.py and the training script's resume below also run
@pytest.mark.parametrize(
    "launcher", list(HF_LAUNCHERS) if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
    else ["python"]
)
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


TRAIN = "docs/examples/train_moe_pipeline.py"
TRAIN_SMALL = ["--steps", "4", "--batch", "8", "--seq-len", "8", "--dim", "16", "--heads", "2",
               "--vocab", "32", "--experts", "4", "--groups", "2", "--limited-groups", "1",
               "--expert-dim", "8", "--warmup", "1", "--bias-rate", "1e-2", "--aux-coeff", "1e-2"]


def _train(args: list[str], launcher: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *launcher, TRAIN, *TRAIN_SMALL, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def test_train_moe_pipeline_check_and_resume_at_another_layout(tmp_path):
    # Run 1 (python, its own 4 gloo processes): pp2 x dp2 with EP2 per stage, 4 steps, --check
    # against one process, a DCP checkpoint after step 2. Run 2 (torchrun): pp1 x dp4 with EP4
    # resumes it for steps 3 and 4, whose losses, grad norms, learning rates and router counts
    # must be run 1's (the expert biases show in the counts, the Adam state in the losses, the
    # router-loss factor of gradient accumulation in the grad norms).
    ckpt, first, resumed = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "resumed.json"
    proc = _train(["--check", "--save-every", "2", "--ckpt-dir", str(ckpt),
                   "--metrics", str(first)], HF_LAUNCHERS["python"])
    assert re.search(r"(?m)^layout: pp=2 dp=2 tp=1 ep=2 ", proc.stdout), proc.stdout
    assert "OK: the run matches one process" in proc.stdout, proc.stdout
    assert (ckpt / "step-2" / ".metadata").is_file() and (ckpt / "step-4").is_dir()
    _train(["--pp", "1", "--dp", "4", "--ep", "4", "--microbatches", "2", "--resume",
            str(ckpt / "step-2"), "--metrics", str(resumed)], HF_LAUNCHERS["torchrun"])
    before = json.loads(first.read_text())["steps"]
    after = json.loads(resumed.read_text())["steps"]
    assert [s["step"] for s in before] == [1, 2, 3, 4] and [s["step"] for s in after] == [3, 4]
    assert all(s["grad_norm"] > 0.5 for s in before), before  # --max-norm 0.5 clips every step
    for ours, theirs in zip(after, before[2:], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ours[key] - theirs[key]) <= 1e-5 * abs(theirs[key]), (key, ours, theirs)
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12), (ours, theirs)
        assert ours["load"] == theirs["load"], (ours, theirs)
