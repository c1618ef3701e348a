"""Checkpoints (DCP) between pipeline stages and layouts without them, on 4 gloo ranks.

Two steps run at pp2 x dp2 with EP2 and FSDP2 in each stage under ``Schedule1F1B``, with one
AdamW per rank and the expert bias updated per stage; every rank saves its stage's model and
optimizer state (the stage modules keep the model's names, so the checkpoint is the whole
model's). Then the checkpoint is loaded at pp1 x dp4 on the same 4 ranks with EP4 (with
``DTENSOR_MOE_FULL_MATRIX=1``), without EP and with EP2, and into one plain process, and a
third step runs in each; the EP2 state is saved
at pp1 and loaded into fresh pipeline stages for a fourth step. Params, Adam step counts and expert biases must continue the
single-process run (1e-5 relative, fp32).

Shape legend: b sequences per micro-batch and dp rank, L tokens per sequence.
"""

# ruff: noqa: N806

from __future__ import annotations

import os
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
from torch.distributed.pipelining import Schedule1F1B
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import build_moe_meshes, fully_shard_moe, parallelize_moe
from dtensor_moe.moe import update_expert_bias
from tests._dist import DistTestBase
from tests.test_parallel_moe import close
from tests.test_pipeline_schedule import (
    N_MICRO,
    PipeLM,
    b,
    build_pipeline,
    loss_fn,
    reference_step,
    tokens,
)

LR, BIAS_RATE = 1e-2, 1e-2
CONFIG = {"use_expert_bias": True}
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"


def _state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _reference(steps: int) -> PipeLM:
    """One process: ``steps`` steps of the micro-batched global batch, AdamW, expert bias."""
    ref = PipeLM(**CONFIG, aux_loss_mode="collect")
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for _ in range(steps):
        reference_step(ref, tokens(2), 2)
        opt.step()
        opt.zero_grad()
        update_expert_bias(ref, BIAS_RATE)
    return ref


def _full_step(model, opt, rows: torch.Tensor, meshes=None) -> None:
    """The same step without micro-batches: the mean loss over ``rows``' tokens (equal-sized
    micro-batches: the mean of their means), then the expert bias (over ``meshes``' ranks)."""
    T = tokens(2)[rows]
    loss_fn(model(T[:, :-1]), T[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    update_expert_bias(model, BIAS_RATE, meshes=meshes)


class PipelineCheckpointTest(DistTestBase):
    def _check(self, model, ref, what: str) -> None:
        ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            close(full.detach(), ref_params[name].detach(), f"{what} {name}")
        biases = [name for name, _ in model.named_buffers() if name.endswith("expert_bias")]
        self.assertEqual(len(biases), 4 // (2 if "-> pp2" in what else 1), what)
        self.assertTrue(any(ref_buffers[n].abs().sum() > 0 for n in biases), what)  # updated
        for name in biases:
            bias = dict(model.named_buffers())[name]
            torch.testing.assert_close(bias, ref_buffers[name], rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{what} {n}: {m}")

    def _resume_at_pp1(self, path: str, ep: int, refs: dict) -> tuple:
        """Load the checkpoint at pp1 x dp4 with EP ``ep`` (FSDP2 on the rest), check it, and
        run a third step on a quarter of the batch per rank; returns the model and optimizer."""
        meshes = build_moe_meshes(dp=4, ep=ep, device_type="cpu")
        model = PipeLM(**CONFIG, aux_loss_mode="attach")
        torch.nn.init.zeros_(model.head.weight)  # the checkpoint must overwrite it
        parallelize_moe(model, meshes, sequence_parallel=False)
        fully_shard_moe(model, meshes, blocks=list(model.layers.values()))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        what = f"pp2 -> pp1 ep{ep}"
        self._check(model, refs[2], f"{what}, loaded")
        self.assertEqual({s["step"].item() for s in opt.state.values()}, {2.0})
        quarter = 2 * N_MICRO * b // 4
        _full_step(model, opt, torch.arange(self.rank * quarter, (self.rank + 1) * quarter),
                   meshes)
        self._check(model, refs[3], f"{what}, step 3")
        return model, opt

    @with_comms
    def test_save_at_pp2_resume_at_pp1_and_in_one_process(self):
        path = [tempfile.mkdtemp(prefix="dtensor_moe_pp_ckpt_") if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        path = path[0]
        try:
            pipe = build_pipeline(self, Schedule1F1B, "single", fsdp=True, config=CONFIG)
            (stage,) = pipe.modules
            opt = torch.optim.AdamW(stage.parameters(), lr=LR)
            d = pipe.meshes.dense.get_local_rank("dp")
            for _ in range(2):
                pipe.step(tokens(2)[d * N_MICRO * b : (d + 1) * N_MICRO * b], [])
                opt.step()
                opt.zero_grad()
                update_expert_bias(stage, BIAS_RATE, meshes=pipe.meshes)
            dcp.save(_state(stage, opt), checkpoint_id=path)

            # pp1 x dp4 on the same ranks, each rank a quarter of the batch, with EP2 (kept for
            # the way back), EP4 and no EP. CI: no EP and EP2; EP4 with DTENSOR_MOE_FULL_MATRIX=1
            # (a pp2 checkpoint resumed at pp1 x EP4: tests/test_examples.py's
            # test_train_moe_pipeline_check_and_resume_at_another_layout)
            refs = {steps: _reference(steps) for steps in (2, 3)}
            for ep in (4, 1, 2) if FULL else (1, 2):
                model, opt = self._resume_at_pp1(path, ep, refs)
            if self.rank == 0:  # the same checkpoint in one plain process
                plain = PipeLM(**CONFIG, aux_loss_mode="attach")
                plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
                state = _state(plain, plain_opt)
                dcp.load(state, checkpoint_id=path, no_dist=True)
                set_model_state_dict(plain, state["model"])
                set_optimizer_state_dict(plain, plain_opt, state["optim"])
                _full_step(plain, plain_opt, torch.arange(2 * N_MICRO * b))
                self._check(plain, refs[3], "pp2 -> one process, step 3")
            dist.barrier()

            # and back: the pp1 checkpoint into fresh pipeline stages, then a fourth step there
            if self.rank == 0:
                shutil.rmtree(path)
            dist.barrier()
            dcp.save(_state(model, opt), checkpoint_id=path)
            pipe = build_pipeline(self, Schedule1F1B, "single", fsdp=True, config=CONFIG)
            (stage,) = pipe.modules
            opt = torch.optim.AdamW(stage.parameters(), lr=LR)
            state = _state(stage, opt)
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(stage, state["model"])
            set_optimizer_state_dict(stage, opt, state["optim"])
            pipe.step(tokens(2)[d * N_MICRO * b : (d + 1) * N_MICRO * b], [])
            opt.step()
            update_expert_bias(stage, BIAS_RATE, meshes=pipe.meshes)
            self._check(stage, _reference(4), "pp1 -> pp2, step 4")
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    run_tests()
