"""Take Hugging Face MoE models to expert parallelism + FSDP2, train, save, export back to HF.

For a tiny random Qwen3-MoE and a tiny random DeepSeek-V3 (built from their config classes: no
download), on 4 CPU/gloo processes:

1. swap every HF MoE block for ``dtensor_moe.MoE`` (``dtensor_moe.hf.replace_moe_blocks``);
2. split the experts over ``ep=2`` ranks (``parallelize_moe``) and shard everything with FSDP2
   (``fully_shard_moe``: experts over ``edp=2``, the rest over ``dp=4``);
3. train 5 steps with one fused AdamW over both meshes and ``dtensor_moe.clip_grad_norm_``;
   each rank takes 2 of the 8 sequences of a batch;
4. check that the loss of every step matches the untouched HF model trained on the whole batch
   in one process (relative 1e-5);
5. save model and optimizer with DCP, export an HF state dict (``to_hf_state_dict``), load it
   strictly into a fresh HF model, ``save_pretrained`` it, and check that
   ``AutoModelForCausalLM.from_pretrained`` of that folder gives the trained model's loss.

Run:  python docs/examples/hf_moe_parallel.py [--out DIR]   (launches 4 gloo processes)
  or: torchrun --standalone --nproc-per-node 4 docs/examples/hf_moe_parallel.py [--out DIR]

The checkpoints go to ``--out DIR``, or by default to a new temporary folder; rank 0 prints
where, first thing.

Needs ``pip install "dtensor_moe[hf]"``. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

import dtensor_moe
from dtensor_moe import build_moe_meshes, fully_shard_moe, hf, parallelize_moe

WORLD, DP, EP = 4, 4, 2
STEPS, BATCH, SEQ_LEN, LR, MAX_NORM = 5, 8, 16, 1e-2, 1.0
TOLERANCE = 1e-5  # relative, on every step's loss

COMMON = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], head_dim=8,
    ),
    "deepseek_v3": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
    ),
}


def build_hf_model(model_type: str):
    """The same random tiny HF model on every rank (seeded), fp32, with decisive routing."""
    config = AutoConfig.for_model(model_type, **COMMON, **MODELS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # router logits far from ties, so every rank routes like one process
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.normal_(0, 0.5)
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def batch(step: int) -> torch.Tensor:
    """Token ids of step ``step``'s global batch, the same on every rank."""
    return torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ_LEN),
                         generator=torch.Generator().manual_seed(1000 + step))


def train_reference(model) -> list[float]:
    """The untouched HF model on the whole batch, in this process alone."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_parallel(model, opt, rank: int) -> list[float]:
    """The swapped, parallelized model: each rank takes its 2 sequences of every batch."""
    rows = slice(rank * BATCH // DP, (rank + 1) * BATCH // DP)
    losses = []
    for step in range(STEPS):
        ids = batch(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss  # the mean over this rank's tokens
        loss.backward()  # FSDP2 averages the grads over dp: the grads of the global mean
        dtensor_moe.clip_grad_norm_(model.parameters(), MAX_NORM)  # over both meshes
        opt.step()
        opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # every rank has as many tokens: the mean of the means
        losses.append(global_loss.item() / WORLD)
    return losses


def run(model_type: str, out: str, rank: int) -> None:
    hf_model = build_hf_model(model_type)
    reference = train_reference(copy.deepcopy(hf_model)) if rank == 0 else [0.0] * STEPS
    ref_losses = torch.tensor(reference, dtype=torch.float64)
    dist.broadcast(ref_losses, src=0)

    model = hf_model
    swapped = hf.replace_moe_blocks(model)
    meshes = build_moe_meshes(dp=DP, ep=EP)
    parallelize_moe(model, meshes, sequence_parallel=False)
    fully_shard_moe(model, meshes, blocks=model.model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)  # one optimizer, two meshes
    losses = train_parallel(model, opt, rank)

    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses.tolist())]
    if rank == 0:
        print(f"{model_type}: swapped {swapped}; ep={EP}, FSDP2 dp={DP} (experts edp="
              f"{meshes.edp}); {STEPS} steps of fused AdamW + dtensor_moe.clip_grad_norm_")
        for step, (ours, theirs) in enumerate(zip(losses, ref_losses.tolist()), start=1):
            print(f"  step {step}: loss {ours:.6f}  single-process HF {theirs:.6f}  "
                  f"rel diff {abs(ours - theirs) / abs(theirs):.1e}")
    if max(rel) > TOLERANCE:
        raise SystemExit(f"{model_type}: loss differs from the single-process HF model by "
                         f"{max(rel):.2e} relative (tolerance {TOLERANCE:.0e})")

    # DCP: model and optimizer state, each rank writing its own shards
    checkpoint = os.path.join(out, model_type, "dcp")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)

    # HF export: full tensors (a collective on every rank), then a plain HF checkpoint
    hf_sd = hf.to_hf_state_dict(model)
    next_ids = batch(STEPS)
    if rank == 0:
        fresh = AutoModelForCausalLM.from_config(hf_model.config).float()
        fresh.load_state_dict(hf_sd, strict=True)
        export = os.path.join(out, model_type, "hf")
        fresh.save_pretrained(export)
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        with torch.no_grad():
            exported = reloaded(input_ids=next_ids, labels=next_ids).loss.item()
    model.eval()  # FSDP2 forward on every rank; the loss of the whole next batch, rank 0 reads it
    with torch.no_grad():
        trained = model(input_ids=next_ids, labels=next_ids).loss.item()
    if rank == 0:
        diff = abs(exported - trained) / abs(trained)
        print(f"  saved DCP to {checkpoint}; exported HF checkpoint to {export}: "
              f"from_pretrained loss {exported:.6f} vs trained model {trained:.6f} "
              f"(rel diff {diff:.1e})")
        if diff > TOLERANCE:
            raise SystemExit(f"{model_type}: the exported HF checkpoint differs from the "
                             f"trained model by {diff:.2e} relative")


def _output_folder(out: str | None, rank: int) -> str:
    """``out``, or a temporary folder that rank 0 creates and every rank then uses."""
    if out is None:
        made = [tempfile.mkdtemp(prefix="hf_moe_parallel_") if rank == 0 else None]
        dist.broadcast_object_list(made, src=0)  # every rank writes its DCP shards there
        out = made[0]
    if rank == 0:
        print(f"writing the DCP checkpoints and HF exports under {os.path.abspath(out)}")
    return out


def main(out: str | None) -> None:
    rank = dist.get_rank()
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"this example needs {WORLD} processes, got {dist.get_world_size()}")
    out = _output_folder(out, rank)
    for model_type in MODELS:
        run(model_type, out, rank)
    if rank == 0:
        print("OK: every step matched the single-process HF model")


def _worker(rank: int, port: int, out: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        main(out)
        dist.barrier()  # every rank tears its gloo connections down together
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="folder for the DCP checkpoints and HF exports "
                             "(default: a new temporary folder)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            main(args.out)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        # fork where it exists: the workers start with torch and transformers already imported
        method = "fork" if sys.platform == "linux" else "spawn"
        mp.start_processes(_worker, args=(free_port, args.out), nprocs=WORLD, start_method=method)
