"""FSDP2 mixed precision (bf16 compute, fp32 reduction and fp32 master params) with EP/TP/SP."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe
from dtensor_moe.parallel import build_moe_meshes, fully_shard_moe, parallelize_moe
from tests._dist import DistTestBase
from tests._moe_layouts import LAYOUTS, local_rows
from tests._moe_model import global_batch, lm_loss, make_model, tensor_parallel_dense

STEPS = 3
# Relative error (in norm) of each bf16-computed, fp32-reduced grad against the fp32 grad: up
# to 1.2e-2 measured (layer-norm and router weights); a grad scaled by a wrong divide factor is
# off by 0.5 or more.
GRAD_RTOL = 3e-2
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(name: str, model):
    layout = LAYOUTS[name]
    meshes = build_moe_meshes(dp=layout.dp, ep=layout.ep, tp=layout.tp, expert_tp=layout.expert_tp)
    if layout.tp > 1:
        tensor_parallel_dense(model, meshes.dense["tp"], sequence_parallel=layout.sequence_parallel)
    if layout.tp > 1 or layout.ep > 1:
        parallelize_moe(model, meshes, sequence_parallel=layout.sequence_parallel)
    fully_shard_moe(model, meshes, blocks=model.layers, mp_policy=MP)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


class FSDPMixedPrecisionTest(DistTestBase):
    @with_comms
    def test_bf16_compute_fp32_master_matches_fp32_reference(self):
        """bf16 params in forward/backward, fp32 grad reduction, fp32 master params and fused
        AdamW, for FSDP alone and with EP, EP over dp x tp with SP, and EP x expert TP with SP
        (L=7: uneven over tp). The loss follows the fp32 single-device run to bf16 accuracy."""
        batches = [global_batch(s, batch=8, seq_len=7) for s in range(STEPS)]
        ref = make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
        ref_losses, ref_grads = [], {}
        for tokens in batches:
            loss = lm_loss(ref, tokens)
            loss.backward()
            if not ref_grads:
                ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.detach())
        for name in ("dp4", "dp4_ep2", "dp2_tp2_ep4_sp", "dp2_ep2_tp2_sp"):
            model, opt = _build(name, copy.deepcopy(make_model()))
            compute_dtypes: list[torch.dtype] = []
            for module in model.modules():
                if isinstance(module, dtensor_moe.MoE):
                    module.experts.register_forward_hook(
                        lambda mod, args, out, seen=compute_dtypes: seen.append(_local(out).dtype)
                    )
            rows = local_rows(name, self.rank, 8)
            for step, tokens in enumerate(batches):
                loss = lm_loss(model, tokens[rows])
                loss.backward()
                for pname, p in model.named_parameters():  # fp32 master params and grads
                    self.assertEqual((p.dtype, p.grad.dtype), (torch.float32,) * 2, pname)
                    if step == 0:  # every grad, reduced as FSDP/EP reduce it, vs fp32
                        want = ref_grads[pname]
                        err = (_full(p.grad) - want).norm() / want.norm()
                        self.assertLess(float(err), GRAD_RTOL, f"{name}: grad of {pname}")
                dtensor_moe.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                avg = loss.detach().float().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                # bf16 has an 8-bit mantissa (relative spacing 2**-8); measured differences are
                # about 2e-4 relative. A wrong reduction (e.g. a grad divided twice) moves the
                # loss by far more after the first step.
                torch.testing.assert_close(
                    avg, ref_losses[step], rtol=2e-3, atol=0,
                    msg=lambda m, n=name, s=step: f"{n}, step {s}: {m}",
                )
            self.assertTrue(compute_dtypes)
            self.assertEqual(set(compute_dtypes), {torch.bfloat16}, name)


class RouterDtypeUnderMixedPrecisionTest(DistTestBase):
    WORLD_SIZE = 2

    @with_comms
    def test_router_dtype_under_bf16_param_dtype(self):
        """Under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the gate weight reaches the
        forward in bf16: ``router_dtype=torch.float32`` computes the logits from it in float32
        (the same bits as ``F.linear`` in float32 on the bf16 values), ``None`` in bf16. The
        gradient reaches the float32 sharded parameter."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        for router_dtype, want in ((torch.float32, torch.float32), (None, torch.bfloat16)):
            torch.manual_seed(0)
            moe = dtensor_moe.MoE(dtensor_moe.MoEConfig(
                dim=16, hidden_dim=32, num_experts=8, top_k=2, init_std=0.5,
                router_dtype=router_dtype))
            w_bf16 = moe.router.gate.weight.detach().bfloat16()  # what the policy hands over
            fully_shard(moe, mesh=mesh, mp_policy=MP)
            seen = []
            moe.router.gate.register_forward_hook(
                lambda mod, args, out: seen.append((mod.weight.dtype, out.detach().clone())))
            x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(self.rank))
            moe(x).float().pow(2).sum().backward()
            weight_dtype, logits = seen[0]
            self.assertEqual(weight_dtype, torch.bfloat16)
            self.assertEqual(logits.dtype, want)
            ref = F.linear(x.bfloat16().reshape(-1, 16).to(want), w_bf16.to(want))
            self.assertTrue(torch.equal(logits, ref), router_dtype)
            grad = moe.router.gate.weight.grad
            self.assertEqual(grad.dtype, torch.float32)
            self.assertGreater(float(_full(grad).norm()), 0.0)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


if __name__ == "__main__":
    run_tests()
