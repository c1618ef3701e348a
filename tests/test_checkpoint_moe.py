"""Checkpoints of FSDP2 + MoE models reshard across layouts and into a single process (DCP)."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe
from dtensor_moe.moe import update_expert_bias
from tests._dist import DistTestBase
from tests._moe_layouts import LAYOUTS, build_layout, local_rows
from tests._moe_model import global_batch, lm_loss, make_model

LR = 1e-3
BIAS_RATE = 1e-2
RTOL = 1e-5
BATCH, SEQ = 8, 6
CONFIG = {"use_expert_bias": True}


def _step(model, opt, tokens, *, group=None, clip=dtensor_moe.clip_grad_norm_) -> torch.Tensor:
    """One training step; the reference passes torch's own clip and no process group."""
    loss = lm_loss(model, tokens)
    loss.backward()
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    update_expert_bias(model, BIAS_RATE, process_group=group)
    return loss.detach()


def _reference_losses(steps: int) -> tuple[list[torch.Tensor], torch.nn.Module]:
    ref = make_model(**CONFIG)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    losses = [
        _step(ref, opt, global_batch(s, BATCH, SEQ), clip=torch.nn.utils.clip_grad_norm_)
        for s in range(steps)
    ]
    return losses, ref


def _state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


class CheckpointReshardTest(DistTestBase):
    def _shared_dir(self) -> str:
        path = [tempfile.mkdtemp(prefix="dtensor_moe_ckpt_") if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        return path[0]

    def _train_parallel(self, layout, model, opt, steps):
        losses = []
        for s in steps:
            tokens = global_batch(s, BATCH, SEQ)[local_rows(layout, self.rank, BATCH)]
            loss = _step(model, opt, tokens, group=dist.group.WORLD)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss)
        return losses

    def _save_then_resume(self, save_layout: str, load_layout: str):
        ref_losses, ref = _reference_losses(5)
        path = self._shared_dir()
        try:
            model, opt = build_layout(save_layout, make_model(**CONFIG))
            self._train_parallel(save_layout, model, opt, range(2))
            dcp.save(_state(model, opt), checkpoint_id=path)
            # resume into a differently initialised model with another layout
            model2, opt2 = build_layout(load_layout, make_model(seed=7, **CONFIG))
            state = _state(model2, opt2)
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model2, state["model"])
            set_optimizer_state_dict(model2, opt2, state["optim"])
            resumed = self._train_parallel(load_layout, model2, opt2, range(2, 5))
            for i, (got, want) in enumerate(zip(resumed, ref_losses[2:])):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0,
                                           msg=lambda m, i=i: f"{save_layout}->{load_layout} "
                                                              f"step {i + 2}: {m}")
            self._check_bias(model2, ref, f"{save_layout}->{load_layout}")
            if self.rank == 0:
                self._resume_single_process(path, ref_losses)
            dist.barrier()
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    def _check_bias(self, model, ref, label):
        ref_buffers = dict(ref.named_buffers())
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                torch.testing.assert_close(buf, ref_buffers[name], rtol=0, atol=1e-7,
                                           msg=lambda m, n=name: f"{label} {n}: {m}")

    def _resume_single_process(self, path: str, ref_losses) -> None:
        """Load the 4-rank checkpoint (saved after step 2) into a plain one-process model."""
        model = make_model(seed=7, **CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=path, no_dist=True)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        steps = [s["step"].item() for s in opt.state.values()]
        self.assertEqual(set(steps), {2.0})
        for s in range(2, 5):
            loss = _step(model, opt, global_batch(s, BATCH, SEQ), clip=torch.nn.utils.clip_grad_norm_)
            torch.testing.assert_close(loss, ref_losses[s], rtol=RTOL, atol=0.0)

    @with_comms
    def test_reshard_save_and_resume(self):
        for save_layout, load_layout in LAYOUTS.reshard_pairs():
            self._save_then_resume(save_layout, load_layout)


if __name__ == "__main__":
    run_tests()
