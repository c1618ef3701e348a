"""A router written as one class and plugged into ``MoE(config, router=...)``.

:class:`HashRouter` routes each token by a fixed hash of its features (the signs of a few fixed
random projections name a bucket ``h``; the token goes to experts ``h, h + 1, ..., h + K - 1``
modulo ``E``) and weights them with a learned softmax gate. It keeps no counters, no expert
bias and no router losses (Note [Router protocol] in ``dtensor_moe/moe/protocol.py``).

* One process: the layer runs it; the protocol's errors (a router lacking members, a wrong
  expert count, a bias without a counter); ``load_stats`` and ``update_expert_bias`` leave it
  out beside a counting router and raise, naming it, when no router of the model counts.
* 4 gloo ranks: the same layer under expert parallelism (EP4 over the data ranks), under
  sequence parallelism with EP borrowing the tp ranks (SP2 x EP2) and under EP2 x expert TP2
  with gathered tokens (each tp rank counts its own slice), and a 4-layer model under
  a pipeline schedule (pp2 x dp2 with EP2 in each stage, built with ``split_stage`` and
  ``build_stage``): 3 fused AdamW steps each, against the same model in one process at 1e-5
  relative (fp32): the output (the losses under the pipeline), the input gradient, every
  parameter gradient of every step, and every parameter after the steps.

Shape legend: T tokens, D dim, E experts, K experts per token, B sequences per data shard,
L tokens per sequence.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE, MoEConfig, build_moe_meshes, parallelize_moe
from dtensor_moe.moe import (
    Router,
    RouterLossSettings,
    RouterOutput,
    load_stats,
    set_aux_loss_group,
    update_expert_bias,
)
from dtensor_moe.moe.router import expert_counts
from dtensor_moe.moe.tokens import RoutedTokens
from dtensor_moe.parallel import build_stage, reduce_gradients, split_stage
from tests._dist import DistTestBase
from tests._moe_model import VOCAB
from tests.test_parallel_moe import LAYOUTS, as_param_grad, close, full, reduce_grad
from tests.test_pipeline_schedule import N_MICRO, L, b, loss_fn, reference_step, tokens

D, H, E, K = 16, 32, 8, 2
STEPS, LR = 3, 1e-2


class HashRouter(nn.Module):
    """Token -> experts by a fixed hash of its features; combine weights from a learned gate."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, seed: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        bits = max(1, (num_experts - 1).bit_length())
        planes = torch.randn(dim, bits, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("planes", planes)
        self.register_buffer("powers", 2 ** torch.arange(bits))
        # what the protocol asks for and this router does not keep
        self.expert_bias = self.tokens_per_expert = self.dropped_per_expert = None
        self.loss_settings = RouterLossSettings()  # no router losses
        self.aux_loss_group, self.aux_loss_scale = None, 1.0
        self.stage_ranks = self.pp_rank = None  # parallelize_moe records the stage here
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate.weight, std=0.3)

    def reset_counters(self) -> None:
        pass  # no counters

    def forward(
        self, x_TD: torch.Tensor, *, tokens: RoutedTokens | None = None, count: bool = True
    ) -> RouterOutput:
        if tokens is None:  # called on its own: every token of a (T, D) input
            tokens = RoutedTokens.whole_batch((1, *x_TD.shape))
        logits_TE = tokens.local(self.gate(x_TD)).reshape(-1, self.num_experts)
        x_local_TD = tokens.local(x_TD.detach()).reshape(logits_TE.shape[0], -1)
        bucket_T = ((x_local_TD.float() @ self.planes > 0).long() * self.powers).sum(-1)
        ids_TK = (bucket_T[:, None] + torch.arange(self.top_k)) % self.num_experts
        scores_TK = logits_TE.float().softmax(dim=-1).gather(-1, ids_TK)
        counts_E = expert_counts(ids_TK, self.num_experts)
        owned_TK = ids_TK if tokens.owned is None else ids_TK[tokens.owned]
        return RouterOutput(
            topk_scores_TK=scores_TK.to(x_TD.dtype),
            topk_ids_TK=ids_TK,
            counts_E=counts_E,
            count_E=expert_counts(owned_TK, self.num_experts),
            aux_loss=None,
        )


def hash_config(**overrides) -> MoEConfig:
    fields = dict(dim=D, hidden_dim=H, num_experts=E, top_k=K, num_shared_experts=1,
                  init_std=0.3)
    fields.update(overrides)
    return MoEConfig(**fields)


def hash_moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(hash_config(), router=HashRouter(D, E, K, seed=seed))


# ----------------------------------------------------------------------------- one process


def test_the_layer_runs_the_router():
    moe = hash_moe()
    assert isinstance(moe.router, Router) and isinstance(moe.router, HashRouter)
    x = torch.randn(2, 5, D, requires_grad=True)
    y = moe(x)
    y.square().sum().backward()
    assert y.shape == x.shape and x.grad.abs().sum() > 0
    assert moe.router.gate.weight.grad.abs().sum() > 0  # the gate trains
    routing = moe.router(x.detach().reshape(-1, D))
    assert routing.topk_ids_TK.shape == (10, K) and routing.counts_E.sum() == 10 * K
    again = moe.router(x.detach().reshape(-1, D))
    assert torch.equal(routing.topk_ids_TK, again.topk_ids_TK)  # a fixed hash
    moe.reset_parameters()  # reaches the router's


class _NoCounters(HashRouter):
    """A router with a bias but no counter: the bias could never move."""

    def __init__(self) -> None:
        super().__init__(D, E, K)
        del self.expert_bias
        self.register_buffer("expert_bias", torch.zeros(E))


def test_protocol_errors():
    with pytest.raises(TypeError, match=r"MoE: the router must be an nn.Module .*got object"):
        MoE(hash_config(), router=object())
    with pytest.raises(TypeError, match=r"MoE: router Linear lacks num_experts, expert_bias, "
                       r"tokens_per_expert, dropped_per_expert, loss_settings, aux_loss_group, "
                       r"aux_loss_scale, stage_ranks, pp_rank, reset_counters "
                       r"of the router protocol \(dtensor_moe.moe.Router\).*'Write a router'"):
        MoE(hash_config(), router=nn.Linear(D, E))
    partial = HashRouter(D, E, K)
    del partial.stage_ranks
    with pytest.raises(TypeError, match=r"router HashRouter lacks stage_ranks of the router"):
        MoE(hash_config(), router=partial)
    with pytest.raises(ValueError, match=r"router HashRouter routes to num_experts=4 experts "
                       r"but the layer has 8 \(MoEConfig.num_experts\)"):
        MoE(hash_config(), router=HashRouter(D, 4, K))
    odd = HashRouter(D, E, K)
    odd.loss_settings = {"aux_loss_coeff": 0.1}
    with pytest.raises(TypeError, match=r"HashRouter.loss_settings must be a "
                       r"RouterLossSettings, got dict"):
        MoE(hash_config(), router=odd)
    with pytest.raises(ValueError, match=r"router _NoCounters holds an expert_bias but no "
                       r"tokens_per_expert counter"):
        MoE(hash_config(), router=_NoCounters())


def test_balance_and_stats_leave_a_router_without_counters_out():
    hashed = hash_moe()
    counted = MoE(hash_config(use_expert_bias=True))
    model = nn.ModuleDict({"hashed": hashed, "counted": counted}).train()
    x = torch.randn(2, 5, D)
    for moe in model.values():
        moe(x)
    (stats,) = load_stats(model, process_group="local")
    assert stats.name == "counted" and stats.total == 10 * K
    update_expert_bias(model, 1e-3)
    assert counted.router.expert_bias.abs().sum() > 0
    assert counted.router.tokens_per_expert.sum() == 0  # reset by the update
    assert hashed.router.expert_bias is None  # nothing to update, nothing raised

    hashed(x)
    with pytest.raises(ValueError, match=r"load_stats found no router with a tokens_per_expert "
                       r"counter in MoE; its routers keep none \(HashRouter at '<root>'\)"):
        load_stats(hashed)
    with pytest.raises(ValueError, match=r"update_expert_bias found no router with an expert "
                       r"bias in MoE; build the MoE layers with MoEConfig\(use_expert_bias=True\)"
                       r".*\(then it does nothing\). Its routers \(HashRouter\) hold none$"):
        update_expert_bias(hashed, 1e-3)
    with pytest.raises(ValueError, match=r"set_aux_loss_group found no router with "
                       r"aux_loss_type='global_batch' in MoE"):
        set_aux_loss_group(hashed, None)


# ------------------------------------------------------------------------------ 4 ranks


class HashBlock(nn.Module):
    """A pre-norm residual MoE block with a hash router."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.moe = hash_moe(seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class HashLM(nn.Module):
    """Embedding, hash-routed blocks (a ModuleDict keyed by index), norm and head; a pipeline
    stage skips the modules it does not hold (``None``)."""

    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed: nn.Module | None = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): HashBlock(seed=1 + i) for i in range(num_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(D)
        self.head: nn.Module | None = nn.Linear(D, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


class RouterPluginParallelTest(DistTestBase):
    def _train_layer(self, layout_name: str, B: int = 2, seq_len: int = 7) -> None:
        """``STEPS`` steps of the hash-routed layer under a layout of ``test_parallel_moe``,
        against one process on the global batch (the mean over the data shards)."""
        layout = LAYOUTS[layout_name]
        meshes = build_moe_meshes(**layout.meshes, device_type="cpu")
        ref = hash_moe()
        model = parallelize_moe(copy.deepcopy(ref), meshes,
                                sequence_parallel=layout.sequence_parallel,
                                expert_tp_dispatch=layout.expert_tp_dispatch)
        if layout.expert_tp_dispatch == "gather":
            self.assertEqual(model.token_parallel.routing, "replicate")
        self.assertEqual(model.router.stage_ranks, tuple(range(self.world_size)))
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        dp, tp = meshes.dp, meshes.tp
        shard = slice((self.rank // tp) * B, (self.rank // tp + 1) * B)
        placement = [Shard(1) if layout.sequence_parallel else Replicate()]
        ref_params = dict(ref.named_parameters())
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(step)
            X, G = torch.randn(2, dp * B, seq_len, D, generator=gen)
            x_ref = X.clone().requires_grad_()
            y_ref = ref(x_ref)
            ((y_ref * G).sum() / dp).backward()
            if tp > 1:
                x = distribute_tensor(X[shard], meshes.dense["tp"], placement).requires_grad_()
                g = distribute_tensor(G[shard], meshes.dense["tp"], placement).to_local()
                y = model(x)
                (y.to_local() * g).sum().backward()
            else:
                x = X[shard].clone().requires_grad_()
                y = model(x)
                (y * G[shard]).sum().backward()
            at = f"{layout_name} step {step}"
            close(full(y), y_ref[shard].detach(), f"{at}: y")
            close(full(x.grad) / dp, x_ref.grad[shard], f"{at}: x.grad")
            for name, param in model.named_parameters():
                param.grad = as_param_grad(param, reduce_grad(name, param, meshes))
                close(full(param.grad), ref_params[name].grad, f"{at}: {name}.grad")
            for optimizer in (opt, opt_ref):
                optimizer.step()
                optimizer.zero_grad()
        for name, param in model.named_parameters():
            close(full(param).detach(), ref_params[name].detach(), f"{layout_name}: {name}")
        self.assertTrue(any(n.startswith("router.gate") for n in ref_params))

    @with_comms
    def test_expert_parallel(self):
        self._train_layer("ep4")

    @with_comms
    def test_sequence_parallel_with_expert_parallel(self):
        self._train_layer("sp2ep2")

    @with_comms
    def test_expert_tensor_parallel_gathered_tokens(self):
        # EP2 x expert TP2 with SP input; every tp rank routes the gathered tokens and counts
        # its own slice (RoutedTokens.owned)
        self._train_layer("ep2tp2_gather")

    @with_comms
    def test_pipeline_with_expert_parallel(self):
        meshes = build_moe_meshes(pp=2, dp=2, ep=2, device_type="cpu")
        full_model = HashLM()
        ref = copy.deepcopy(full_model)
        module = split_stage(full_model, meshes.pp_rank, meshes.pp, first=("embed",),
                             last=("norm", "head"))
        parallelize_moe(module, meshes, sequence_parallel=False)
        first, last = meshes.pp_rank == 0, meshes.pp_rank == meshes.pp - 1
        hidden = torch.empty(b, L, D)
        stage = build_stage(
            module, meshes, stage_index=meshes.pp_rank, num_stages=meshes.pp,
            input_args=torch.empty(b, L, dtype=torch.long) if first else hidden,
            output_args=torch.empty(b, L, VOCAB) if last else hidden,
        )
        schedule = Schedule1F1B(stage, N_MICRO, loss_fn=loss_fn)
        opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-3, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-3)
        ref_params = dict(ref.named_parameters())
        T = tokens(meshes.dp)
        d = meshes.dense.get_local_rank("dp")
        rows = T[d * N_MICRO * b : (d + 1) * N_MICRO * b]  # this pipeline's
        for step in range(STEPS):
            losses: list[torch.Tensor] = []
            targets = dict(target=rows[:, 1:], losses=losses) if last else {}
            schedule.step(*([rows[:, :-1]] if first else []), **targets)
            ref_losses = reference_step(ref, T, meshes.dp)
            reduce_gradients(module, meshes)  # the mean over the two pipelines
            at = f"pp step {step}"
            if last:
                got = torch.stack(losses).detach()
                dist.all_reduce(got, group=meshes.dense.get_group("dp"))
                close(got / meshes.dp, torch.stack(ref_losses), f"{at}: losses")
            for name, param in module.named_parameters():
                self.assertIsNotNone(param.grad, f"{at}: {name}")
                close(full(param.grad), ref_params[name].grad, f"{at}: {name}.grad")
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        names = [n for n, _ in module.named_parameters()]
        self.assertTrue(any(".router.gate." in n for n in names), names)
        self.assertTrue(any(".experts." in n for n in names), names)
        for name, param in module.named_parameters():
            close(full(param).detach(), ref_params[name].detach(), f"pp after: {name}")


if __name__ == "__main__":
    run_tests()
