"""Train a DeepSeek-V3-style MoE language model under pipeline x FSDP2 x expert parallelism.

The model: token embedding, causal self-attention with rotary positions in every layer, a dense
SwiGLU feed-forward in the first layer and MoE feed-forwards in the others (sigmoid router,
group-limited routing, auxiliary-loss-free expert bias, one shared expert, a small
sequence-level balance loss on the attach route), final RMSNorm and LM head.

The layout comes from ``--pp --dp --ep --tp`` (world size ``pp * dp * tp``; 4 by default:
two pipeline stages of two ranks, FSDP2 over the two pipelines, EP2 inside each stage). With
``--tp > 1`` the dense layers run tensor and sequence parallelism and EP borrows the tp ranks.
Each step: the schedule's forward and backward of every micro-batch (gradient accumulation at
``--pp 1``), the gradients of the mean loss over the global batch (``reduce_gradients``),
clipping by the norm over every stage, AdamW with a warmup + cosine learning rate, the load
statistics of every MoE layer of the model, the expert-bias update, and a DCP checkpoint every
``--save-every`` steps, which ``--resume`` loads at this or another layout. ``--check`` then
trains the same steps in one process, without the package's parallel helpers, and compares.

Run:  python docs/examples/train_moe_pipeline.py [flags]   (launches pp*dp*tp gloo processes)
  or: torchrun --standalone --nproc-per-node 4 docs/examples/train_moe_pipeline.py [flags]

Shape legend: B sequences, L tokens per sequence, D model width, V vocabulary, h heads held by
this rank, Dh head width, b sequences per micro-batch of one pipeline.
"""

# ruff: noqa: N806, N812

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import dtensor_moe
from dtensor_moe import MoE, MoEConfig, MoEMeshes, build_moe_meshes, collect_aux_losses
from dtensor_moe.moe import load_stats, set_router_loss_scale, update_expert_bias
from dtensor_moe.parallel import (
    DenseNames,
    build_stage,
    check_batch,
    dense_tp_plan,
    fully_shard_moe,
    parallelize_moe,
    reduce_gradients,
    split_stage,
)

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
TOLERANCE = 1e-5  # --check: relative difference of every step's loss and grad norm
# the optimizer state under flat keys by param name, param groups too: each stage writes its own
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--pp", type=int, default=2, help="pipeline stages")
    add("--dp", type=int, default=2, help="data-parallel degree (FSDP2) of each stage")
    add("--ep", type=int, default=2, help="expert-parallel degree inside each stage")
    add("--tp", type=int, default=1, help="tensor + sequence parallelism of the dense layers")
    add("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    add("--steps", type=int, default=8, help="the run's last step (also after --resume)")
    add("--batch", type=int, default=8, help="sequences per step (global batch)")
    add("--microbatches", type=int, default=4, help="micro-batches per step and pipeline")
    add("--seq-len", type=int, default=16)
    add("--layers", type=int, default=4, help="layer 0 dense, the others MoE")
    add("--dim", type=int, default=32)
    add("--heads", type=int, default=4)
    add("--vocab", type=int, default=64)
    add("--experts", type=int, default=8, help="routed experts per MoE layer")
    add("--top-k", type=int, default=2)
    add("--groups", type=int, default=4, help="expert groups (group-limited routing)")
    add("--limited-groups", type=int, default=2, help="groups each token may use")
    add("--expert-dim", type=int, default=16, help="hidden width of each expert")
    add("--lr", type=float, default=1e-2, help="peak learning rate")
    add("--warmup", type=int, default=2, help="warmup steps, then cosine decay to --steps")
    add("--min-lr", type=float, default=0.1, help="final learning rate, as a share of --lr")
    add("--weight-decay", type=float, default=0.1)
    add("--max-norm", type=float, default=0.5, help="gradient clipping (it clips here)")
    add("--bias-rate", type=float, default=1e-3, help="expert-bias update rate")
    add("--aux-coeff", type=float, default=1e-4, help="sequence balance loss (0: none)")
    add("--seed", type=int, default=0)
    add("--save-every", type=int, default=0, help="a DCP checkpoint every N steps (0: none)")
    add("--ckpt-dir", default="checkpoints", help="checkpoints go to DIR/step-N")
    add("--resume", default=None, metavar="DIR", help="a checkpoint folder (DIR/step-N)")
    add("--stats-every", type=int, default=4, help="print the load statistics every N steps")
    add("--check", action="store_true", help="compare with the same steps in one process")
    add("--metrics", default=None, metavar="FILE", help="write every step's figures as JSON")
    args = p.parse_args(argv)
    if args.batch % (args.dp * args.microbatches):
        p.error(f"--batch {args.batch} must split into --dp {args.dp} pipelines of "
                f"--microbatches {args.microbatches} equal micro-batches")
    if args.layers % args.pp or args.layers < 2:
        p.error(f"--layers {args.layers} must be >= 2 and split evenly into --pp {args.pp} "
                "stages")
    return args


# ---------------------------------------------------------------------------------------------
# The model: written for one device; the layout is applied afterwards (parallelize below).


def rope(x_BLhDh: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over dim 1 of ``(B, L, h, Dh)``, positions ``0..L-1``."""
    _, L, _, Dh = x_BLhDh.shape
    freqs = 10000.0 ** (-torch.arange(0, Dh, 2, dtype=torch.float32) / Dh)
    angles = torch.outer(torch.arange(L, dtype=torch.float32), freqs)[None, :, None, :]
    x1, x2 = x_BLhDh.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * angles.cos() - x2 * angles.sin(),
                        x1 * angles.sin() + x2 * angles.cos()], dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention; ``view(B, L, -1, Dh)`` also fits ``h / tp`` heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q, k, v = (w(x_BLD).view(B, L, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rope(q).transpose(1, 2), rope(k).transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class FeedForward(nn.Module):
    """The dense SwiGLU feed-forward of the first layer."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + ffn(ffn_norm(x))``; ``ffn`` is dense or MoE."""

    def __init__(self, args: argparse.Namespace, ffn: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
        self.attn = Attention(args.dim, args.heads)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """``forward(tokens (B, L)) -> logits (B, L, V)``; as a pipeline stage (``split_stage``)
    it skips the modules other stages hold, taking and returning the residual stream
    ``(B, L, D)``. Under sequence parallelism (``sp_mesh`` set by :func:`parallelize`) the
    stream inside a stage is a ``Shard(1)`` DTensor and the full plain tensor between stages."""

    def __init__(self, args: argparse.Namespace, moe: MoEConfig) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(args.vocab, args.dim)
        ffns = [FeedForward(args.dim, 4 * args.dim)] + [MoE(moe) for _ in range(args.layers - 1)]
        self.layers = nn.ModuleDict({str(i): Block(args, f) for i, f in enumerate(ffns)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim)
        self.head: nn.Module | None = nn.Linear(args.dim, args.vocab, bias=False)
        self.sp_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(x)
        elif self.sp_mesh is not None:  # the received full stream -> this rank's sequence shard
            h = DTensor.from_local(x, self.sp_mesh, [Replicate()], run_check=False)
            h = h.redistribute(self.sp_mesh, [Shard(1)])
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h)
        if self.head is None and self.sp_mesh is not None:
            h = h.redistribute(self.sp_mesh, [Replicate()]).to_local()
        elif self.head is not None:
            h = self.head(self.norm(h))
        # under TP the tensors above are views of a DTensor's local tensor, which FSDP2 warns
        # about (an in-place op on a module's output view would skip its backward hook)
        return h.clone() if self.sp_mesh is not None else h


def moe_config(args: argparse.Namespace, aux_loss_mode: str) -> MoEConfig:
    return MoEConfig(
        dim=args.dim, hidden_dim=args.expert_dim, num_experts=args.experts, top_k=args.top_k,
        score_func="sigmoid", route_norm=True, route_scale=2.5,
        num_expert_groups=args.groups, num_limited_groups=args.limited_groups,
        use_expert_bias=True, num_shared_experts=1,
        aux_loss_coeff=args.aux_coeff, aux_loss_type="sequence", aux_loss_mode=aux_loss_mode,
    )


def build_model(args: argparse.Namespace, aux_loss_mode: str = "attach") -> Transformer:
    """The whole model, the same weights in every process (seeded). Router gates start at the
    ``1/sqrt(D)`` scale, so that score gaps stay far above float rounding and a parallel run
    routes every token as one process does."""
    torch.manual_seed(args.seed)
    model = Transformer(args, moe_config(args, aux_loss_mode))
    for module in model.modules():
        if isinstance(module, MoE):
            nn.init.normal_(module.router.gate.weight, std=args.dim**-0.5)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the matrices, none on norms (1-D params)."""
    decay, rest = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 else rest).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine decay to ``--min-lr`` at ``--steps``."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def global_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Step ``step``'s ``(batch, seq_len + 1)`` tokens, the same on every rank and after a
    resume: each sequence counts up from a random start by a random stride, modulo V."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    return (start + stride * torch.arange(args.seq_len + 1)) % args.vocab


def loss_fn(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())


# ---------------------------------------------------------------------------------------------
# The layout: split, shard, stage, schedule.


def tp_plan(module: Transformer) -> dict:
    """The dense layers' tensor + sequence parallel plan: the package's plan for the
    embedding, attention, norms and head, plus the first layer's dense feed-forward (its input
    gathered once, its output reduce-scattered to the sequence shards)."""
    names = DenseNames(
        embedding="embed" if module.embed is not None else None,
        gathered=("attn",), colwise=("attn.wq", "attn.wk", "attn.wv"), rowwise=("attn.wo",),
        norms=("attn_norm", "ffn_norm"),
        final_norm="norm" if module.norm is not None else None,
        output="head" if module.head is not None else None,
    )
    plan = dense_tp_plan(module, sequence_parallel=True, names=names)
    for name, layer in module.layers.items():
        if isinstance(layer.ffn, FeedForward):
            ffn = f"layers.{name}.ffn"
            plan[ffn] = PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),))
            plan[f"{ffn}.w1"] = plan[f"{ffn}.w3"] = ColwiseParallel()
            plan[f"{ffn}.w2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def parallelize(module: Transformer, meshes: MoEMeshes) -> None:
    """TP + SP of the dense layers (tp > 1), EP of the experts, then FSDP2: the experts over
    ``edp``, each block and the rest over ``dp``. Under a schedule FSDP2 keeps the params
    gathered from forward to backward (``reshard_after_forward=False``, docs/pipeline.md)."""
    if meshes.tp > 1:
        parallelize_module(module, meshes.dense["tp"], tp_plan(module))
        module.sp_mesh = meshes.dense["tp"]
    if meshes.tp > 1 or meshes.ep > 1:
        parallelize_moe(module, meshes, sequence_parallel=meshes.tp > 1)
    fully_shard_moe(module, meshes, blocks=list(module.layers.values()),
                    reshard_after_forward=meshes.pp == 1)


@dataclass(kw_only=True)
class Trainer:
    """This rank's part of the run: its stage module (the whole model at ``--pp 1``), the
    schedule (``None`` at ``--pp 1``), the optimizer and the learning-rate schedule."""

    args: argparse.Namespace
    meshes: MoEMeshes
    module: Transformer
    schedule: object | None
    opt: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LambdaLR
    step: int = 0  # steps done

    @property
    def dp_rank(self) -> int:
        return self.meshes.dense.get_local_rank("dp")


def build_trainer(args: argparse.Namespace) -> Trainer:
    meshes = build_moe_meshes(pp=args.pp, dp=args.dp, ep=args.ep, tp=args.tp)
    module = build_model(args)
    if meshes.pp > 1:  # keep this stage's part, with the full model's names
        split_stage(module, meshes.pp_rank, meshes.pp, layers="layers",
                    first=("embed",), last=("norm", "head"))
    parallelize(module, meshes)
    schedule = None
    if meshes.pp > 1:
        b = args.batch // (args.dp * args.microbatches)  # one micro-batch of one pipeline
        hidden = torch.empty(b, args.seq_len, args.dim)
        stage = build_stage(
            module, meshes, stage_index=meshes.pp_rank, num_stages=meshes.pp,
            input_args=torch.empty(b, args.seq_len, dtype=torch.long) if meshes.pp_rank == 0
            else hidden,
            output_args=torch.empty(b, args.seq_len, args.vocab)
            if meshes.pp_rank == meshes.pp - 1 else hidden,
        )
        schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=loss_fn)
    else:  # gradient accumulation: each micro-batch's loss is divided by their number
        set_router_loss_scale(module, 1 / args.microbatches)
    opt = torch.optim.AdamW(param_groups(module, args.weight_decay), lr=args.lr, fused=True)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    return Trainer(args=args, meshes=meshes, module=module, schedule=schedule, opt=opt,
                   lr_schedule=lr_schedule)


# ---------------------------------------------------------------------------------------------
# One training step.


def forward_backward(t: Trainer, rows: torch.Tensor) -> torch.Tensor | None:
    """Forward and backward of every micro-batch of this pipeline's ``rows``; the mean loss over
    them where this rank computes it (the last stage), else ``None``."""
    inputs, target = rows[:, :-1], rows[:, 1:]
    first, last = t.meshes.pp_rank == 0, t.meshes.pp_rank == t.meshes.pp - 1
    losses: list[torch.Tensor] = []
    if t.schedule is not None:
        # every rank checks every rank's batch first: a batch that does not split into the
        # micro-batches raises the same ValueError everywhere, before any send
        check_batch(t.schedule, inputs=inputs if first else None,
                    target=target if last else None)
        t.schedule.step(*([inputs] if first else []),
                        **(dict(target=target, losses=losses) if last else {}))
    else:
        n = t.args.microbatches
        for m, (x, y) in enumerate(zip(inputs.chunk(n), target.chunk(n), strict=True)):
            t.module.set_requires_gradient_sync(m == n - 1)  # FSDP2 reduces once, at the last
            loss = loss_fn(t.module(x), y)
            (loss / n).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean() if last else None


def train_step(t: Trainer) -> dict:
    """One optimizer step; returns its figures (the same on every rank)."""
    args, meshes = t.args, t.meshes
    rows = global_batch(args, t.step).chunk(args.dp)[t.dp_rank]  # this pipeline's sequences
    lr = t.lr_schedule.get_last_lr()[0]
    loss = forward_backward(t, rows)
    reduce_gradients(t.module, meshes)  # the grads of the mean loss over the global batch
    norm = dtensor_moe.clip_grad_norm_(t.module.parameters(), args.max_norm,
                                       meshes=meshes)  # the norm over every stage's grads
    t.opt.step()
    t.lr_schedule.step()
    t.opt.zero_grad(set_to_none=True)
    stats = load_stats(t.module, meshes=meshes)  # every MoE layer of the model, on every rank
    update_expert_bias(t.module, args.bias_rate, meshes=meshes)  # this stage's layers
    total = torch.zeros((), dtype=torch.float64) if loss is None else loss.to(torch.float64)
    dist.all_reduce(total)  # the loss is known on the last stage's dp * tp ranks
    t.step += 1
    return {"step": t.step, "loss": total.item() / (args.dp * args.tp), "lr": lr,
            "grad_norm": norm.item(), "load": {s.name: list(s.counts) for s in stats},
            "lines": [s.line() for s in stats]}


# ---------------------------------------------------------------------------------------------
# Checkpoints: every rank saves its stage's state; the names are the whole model's, so the
# checkpoint loads at any layout (docs/pipeline.md).


def _state(t: Trainer) -> dict:
    return {
        "model": get_model_state_dict(t.module),  # params and expert biases (buffers)
        "optim": get_optimizer_state_dict(t.module, t.opt, options=OPTIM_OPTIONS),
        "progress": {"step": t.step, "lr_schedule": t.lr_schedule.state_dict()},
    }


def save(t: Trainer, path: str) -> None:
    dcp.save(_state(t), checkpoint_id=path)


def resume(t: Trainer, path: str) -> None:
    state = _state(t)
    dcp.load(state, checkpoint_id=path)  # this rank's shards of its stage, whatever the layout
    set_model_state_dict(t.module, state["model"])
    set_optimizer_state_dict(t.module, t.opt, state["optim"], options=OPTIM_OPTIONS)
    t.lr_schedule.load_state_dict(state["progress"]["lr_schedule"])
    t.step = int(state["progress"]["step"])


# ---------------------------------------------------------------------------------------------
# --check: the same steps in one process, with torch's AdamW and clipping and a hand-written
# bias update; the router losses collected and added to the loss.


def reference_step(model: Transformer, tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """Forward and backward of the step's global micro-batches: micro-batch m is the m-th
    chunk of every pipeline's rows; returns the mean loss."""
    pipelines = tokens.chunk(args.dp)
    losses = []
    for m in range(args.microbatches):
        rows = torch.cat([p.chunk(args.microbatches)[m] for p in pipelines])
        with collect_aux_losses() as router_losses:
            loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
        ((loss + router_losses.total()) / args.microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item()


def reference_bias_update(model: nn.Module, rate: float) -> dict[str, list[int]]:
    """``bias += rate * centred(sign(mean(c) - c))`` from each router's counts ``c``; returns
    the counts by layer and zeroes them."""
    counts = {}
    for name, moe in model.named_modules():
        if isinstance(moe, MoE):
            router = moe.router
            c = router.tokens_per_expert.to(torch.float64)
            counts[name] = router.tokens_per_expert.tolist()
            if c.sum() > 0:
                delta = torch.sign(c.mean() - c)
                router.expert_bias.add_(((delta - delta.mean()) * rate).float())
            router.tokens_per_expert.zero_()
            router.forwards_since_bias_update = 0  # counts forwards for a forgotten-update warning
    return counts


def reference_run(args: argparse.Namespace, steps: int) -> list[dict]:
    model = build_model(args, aux_loss_mode="collect")
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, fused=True)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    out = []
    for step in range(steps):
        loss = reference_step(model, global_batch(args, step), args)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        lr_schedule.step()
        opt.zero_grad(set_to_none=True)
        counts = reference_bias_update(model, args.bias_rate)
        out.append({"loss": loss, "grad_norm": norm.item(), "load": counts})
    return out


def check(args: argparse.Namespace, steps: list[dict]) -> tuple[bool, list[str]]:
    """Compare this run's steps with the reference's steps of the same numbers."""
    ref = reference_run(args, steps[-1]["step"])
    loss_rel = [abs(s["loss"] - ref[s["step"] - 1]["loss"]) / abs(ref[s["step"] - 1]["loss"])
                for s in steps]
    norm_rel = [abs(s["grad_norm"] - ref[s["step"] - 1]["grad_norm"])
                / ref[s["step"] - 1]["grad_norm"] for s in steps]
    routed_alike = all(s["load"] == ref[s["step"] - 1]["load"] for s in steps)
    ok = max(loss_rel) <= TOLERANCE and max(norm_rel) <= TOLERANCE and routed_alike
    lines = [
        f"check: steps {steps[0]['step']}-{steps[-1]['step']} against one process "
        f"(torch AdamW, torch clip_grad_norm_, hand-written bias update):",
        f"  largest relative difference (tolerance {TOLERANCE:.0e}): loss {max(loss_rel):.1e}, "
        f"grad norm {max(norm_rel):.1e}",
        f"  tokens per expert of every MoE layer and step: "
        f"{'identical' if routed_alike else 'DIFFERENT'}",
        "OK: the run matches one process" if ok else "FAILED: the run differs from one process",
    ]
    return ok, lines


# ---------------------------------------------------------------------------------------------


def describe(t: Trainer) -> list[str]:
    args, m = t.args, t.meshes
    n_params = sum(p.numel() for p in build_model(args).parameters())
    b = args.batch // (args.dp * args.microbatches)
    how = f"schedule {args.schedule}" if m.pp > 1 else "gradient accumulation"
    return [
        f"layout: pp={m.pp} dp={m.dp} tp={m.tp} ep={m.ep} (edp={m.edp}) on "
        f"{dist.get_world_size()} processes; FSDP2 in every stage",
        f"model: {args.layers} layers (layers.0 dense, the rest MoE: {args.experts} experts "
        f"top-{args.top_k}, sigmoid, {args.groups} groups / {args.limited_groups} per token, "
        f"1 shared expert, expert bias), {n_params:,} params",
        f"batch: {args.batch} sequences of {args.seq_len} tokens per step; {how}, "
        f"{args.microbatches} micro-batches of {b} sequence{'s' * (b != 1)} per pipeline",
    ]


def check_world(args: argparse.Namespace) -> None:
    """Under torchrun: the degrees must fill the world (every rank decides alike)."""
    world = dist.get_world_size()
    if args.pp * args.dp * args.tp != world:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} must be the "
                         f"world size {world}")


def main(args: argparse.Namespace) -> None:
    check_world(args)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    t = build_trainer(args)
    for line in describe(t):
        say(line)
    if args.resume:
        resume(t, args.resume)
        say(f"resumed from {args.resume} after step {t.step}")
    steps = []
    while t.step < args.steps:
        s = train_step(t)
        steps.append(s)
        say(f"step {s['step']:3d}/{args.steps}  loss {s['loss']:.6f}  lr {s['lr']:.2e}  "
            f"grad norm {s['grad_norm']:.4f}")
        if s["step"] % args.stats_every == 0 or s["step"] == args.steps:
            for line in s["lines"]:
                say(f"    {line}")
        if args.save_every and s["step"] % args.save_every == 0:
            path = os.path.join(args.ckpt_dir, f"step-{s['step']}")
            save(t, path)
            say(f"saved checkpoint {path}")
    ok = True
    if args.check and steps:
        verdict = [check(args, steps) if rank == 0 else None]
        dist.broadcast_object_list(verdict, src=0)  # every rank exits alike
        ok, lines = verdict[0]
        for line in lines:
            say(line)
    if args.metrics and rank == 0:
        with open(args.metrics, "w") as f:
            json.dump({"steps": [{k: v for k, v in s.items() if k != "lines"} for s in steps]},
                      f, indent=1)
    if not ok:
        raise SystemExit(1)


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    try:
        main(args)
        dist.barrier()  # every rank tears its gloo connections down together
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _run(args)


if __name__ == "__main__":
    cli = parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        _run(cli)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        world_size = cli.pp * cli.dp * cli.tp
        # fork where it exists: the workers start with torch already imported
        method = "fork" if sys.platform == "linux" else "spawn"
        try:
            mp.start_processes(_worker, args=(world_size, free_port, cli), nprocs=world_size,
                               start_method=method)
        except mp.ProcessExitedException as e:
            sys.exit(e.exit_code or 1)
