"""A Hugging Face MoE block against the ``dtensor_moe.MoE`` made from it, side by side.

What a user of ``transformers`` would otherwise run: the model's own MoE block, with one of the
experts implementations transformers offers (``config._experts_implementation``: ``grouped_mm``,
a model's default where it can run, sorts the token-expert pairs and calls ``torch._grouped_mm``;
``eager``, the fallback, loops over the hit experts; ``batched_mm`` gathers every pair's expert
weights). Ours is
``dtensor_moe.hf.moe_from_hf(block)``: the same weights and the same math.

Both sides run forward and backward on the same input and upstream gradient; per repeat each
side is timed once, in alternating order, with the device queue drained around it on an
accelerator. Printed: the parity of each HF implementation against ours (relative error of the
output and of ``x.grad``), each side's median step, and the median per-repeat ratio
``HF / ours`` (above 1: ours is faster).

Run::

    pip install -e ".[hf]"
    python benchmarks/hf_block.py                                  # qwen3_moe, CPU, fp32
    python benchmarks/hf_block.py --family deepseek_v3
    python benchmarks/hf_block.py --device cuda --dtype bf16 --tokens 8192 --dim 2048 \\
        --hidden 768 --experts 128 --top-k 8                       # Qwen3-30B-A3B's block
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")
IMPLS = ("eager", "grouped_mm", "batched_mm")


def _block(args: argparse.Namespace) -> torch.nn.Module:
    """A randomly initialised HF MoE block of ``--family`` (built from its config class)."""
    import transformers

    common = dict(hidden_size=args.dim, num_experts_per_tok=args.top_k)
    if args.family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = transformers.Qwen3MoeConfig(
            **common, num_experts=args.experts, moe_intermediate_size=args.hidden,
            norm_topk_prob=True)
        block_cls = Qwen3MoeSparseMoeBlock
    elif args.family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = transformers.MixtralConfig(
            **common, num_local_experts=args.experts, intermediate_size=args.hidden)
        block_cls = MixtralSparseMoeBlock
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        config = transformers.DeepseekV3Config(
            **common, n_routed_experts=args.experts, moe_intermediate_size=args.hidden,
            n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
            norm_topk_prob=True)
        block_cls = DeepseekV3MoE
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: fast at full size on a GPU
        block = block_cls(config)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.02)
        for name, buf in block.named_buffers():
            if "bias" in name:  # DeepSeek's correction bias: a spread that changes the choice
                buf.copy_(torch.linspace(-0.01, 0.01, buf.numel()))
    block = block.to(device=args.device, dtype=DTYPES[args.dtype])
    if args.family == "deepseek_v3":  # as from_pretrained leaves it: the model class keeps the
        block.gate.float()  # router in float32 (_keep_in_fp32_modules_strict), as does ours
    return block


def _set_impl(block: torch.nn.Module, impl: str) -> None:
    for module in block.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = impl


def _step(module: torch.nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> None:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_y)


def _parity(hf_block, ours, x, grad_y) -> tuple[float, float]:
    results = []
    for module in (hf_block, ours):
        xi = x.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = module(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_y)
        results.append((out.detach().double(), xi.grad.double()))
    (y_hf, g_hf), (y, g) = results
    return (float((y_hf - y).norm() / y.norm()), float((g_hf - g).norm() / g.norm()))


def _timer(device: str) -> Callable[[Callable[[], None]], float]:
    def timed(fn: Callable[[], None]) -> float:
        if device != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.accelerator.synchronize()
        return time.perf_counter() - start

    return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=["eager", "grouped_mm"],
                   help="the HF experts implementations to time")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--plain-routed-step", action="store_true",
                   help="ours with MoEConfig(fused_routed_step=False)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args()
    small = [f"--{n.replace('_', '-')}" for n in ("repeats", "tokens", "dim", "hidden", "threads")
             if getattr(args, n) < 1]
    if small or args.warmup < 0:
        p.error(f"{', '.join(small) or '--warmup'}: must be at least 1 (--warmup at least 0)")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be between 1 and --experts ({args.experts}), got {args.top_k}")
    if args.family == "deepseek_v3" and (args.experts % 8 or args.experts < 16
                                         or args.top_k > args.experts // 2):
        p.error(f"--family deepseek_v3 routes in 8 expert groups of which a token uses 4: "
                f"--experts must be a multiple of 8 and at least 16, and --top-k at most half "
                f"of it; got --experts {args.experts} --top-k {args.top_k}")
    if args.device != "cpu":
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as err:
            p.error(f"--device {args.device} is not available here: {err}")
    try:
        import transformers
    except ImportError:
        p.error('needs transformers: pip install -e ".[hf]"')
    from dtensor_moe import hf

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    block = _block(args)
    ours = hf.moe_from_hf(block, fused_routed_step=not args.plain_routed_step)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.dim, generator=gen).to(args.device, dtype)
    grad_y = torch.randn(1, args.tokens, args.dim, generator=gen).to(args.device, dtype)
    x.requires_grad_()
    print(f"{args.family} T={args.tokens} D={args.dim} H={args.hidden} E={args.experts} "
          f"K={args.top_k} {args.dtype} device={args.device} torch {torch.__version__} "
          f"transformers {transformers.__version__}")
    print(f"ours: {ours.experts.extra_repr()}")

    sides: dict[str, Callable[[], None]] = {"ours": lambda: _step(ours, x, grad_y)}
    for impl in args.impls:
        _set_impl(block, impl)
        try:
            err_y, err_g = _parity(block, ours, x, grad_y)
        except Exception as err:  # an implementation this transformers/torch lacks
            print(f"HF {impl}: not run ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
            continue
        print(f"parity HF {impl} vs ours: output rel err {err_y:.1e}, x.grad rel err {err_g:.1e}")

        def hf_step(impl=impl) -> None:
            _set_impl(block, impl)
            _step(block, x, grad_y)

        sides[f"HF {impl}"] = hf_step

    timed = _timer(args.device)
    names = list(sides)
    for _ in range(args.warmup):
        for name in names:
            sides[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(sides[name]))
    print(f"{'side':<16}{'step ms (median)':>18}{'HF / ours (median)':>22}")
    for name in names:
        ratio = "" if name == "ours" else "%.2f" % statistics.median(
            t / o for t, o in zip(times[name], times["ours"]))
        print(f"{name:<16}{1e3 * statistics.median(times[name]):>18.2f}{ratio:>22}")


if __name__ == "__main__":
    main()
