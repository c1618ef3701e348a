"""MoE layer forward+backward step time against its expert-compute floor, side by side.

Shape legend: T tokens, D dim, R routed rows, e local experts.

The *floor* is ``grouped_swiglu`` forward+backward on exactly the routed rows and per-expert
counts that the layer produced, with the compute path the layer resolves to. ``step / floor``
is the cost of routing, dispatch and combine (and shared experts when enabled) on top of the
expert math. Step and floor are timed alternately in every repeat; medians are reported.

Run::

    python benchmarks/moe_layer.py                 # layout "single": one process
    python benchmarks/moe_layer.py --shared 1      # with one shared expert

Layouts: ``--layout`` picks an entry of ``LAYOUTS``; a parallel layout adds a function with the
same signature (``args -> dict of timings``) that launches its own processes.
"""

# ruff: noqa: N806

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dtensor_moe.moe import MoE, MoEConfig, grouped_swiglu
from dtensor_moe.moe.experts import resolve_compute_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _build(args: argparse.Namespace) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = MoEConfig(
        dim=args.dim,
        hidden_dim=args.hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        num_shared_experts=args.shared,
        compute_path=args.path,
    )
    dtype = DTYPES[args.dtype]
    moe = MoE(config).to(dtype)
    x = torch.randn(1, args.tokens, args.dim, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(1, args.tokens, args.dim, dtype=dtype)
    return moe, x, grad_y


def _routed_rows(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed buffer and counts the layer feeds its experts, as detached leaves."""
    with torch.no_grad():
        x_TD = x.reshape(-1, x.shape[-1])
        routing = moe.router(x_TD)
        routed_RD, counts_e, _ = moe.experts.dispatcher.dispatch(
            x_TD, routing.topk_scores_TK, routing.topk_ids_TK, routing.counts_E
        )
    return routed_RD.clone().requires_grad_(), counts_e


def run_single(args: argparse.Namespace) -> dict[str, object]:
    """One process: the layer step and the expert floor, alternately, ``args.repeats`` times."""
    moe, x, grad_y = _build(args)
    routed_RD, counts_e = _routed_rows(moe, x)
    ex = moe.experts
    path = resolve_compute_path(args.path, routed_RD, ex.w1, counts_e.tolist())
    grad_RD = torch.randn_like(routed_RD)

    def step() -> None:
        moe(x).backward(grad_y)

    def floor() -> None:
        grouped_swiglu(routed_RD, ex.w1, ex.w2, ex.w3, counts_e, path).backward(grad_RD)

    for _ in range(args.warmup):
        step(), floor()
    steps, floors = [], []
    for _ in range(args.repeats):
        steps.append(_timed(step))
        floors.append(_timed(floor))
    return {
        "path": path,
        "counts": counts_e.tolist(),
        "step_ms": 1e3 * statistics.median(steps),
        "floor_ms": 1e3 * statistics.median(floors),
        "ratio": statistics.median(s / f for s, f in zip(steps, floors)),
    }


LAYOUTS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {"single": run_single}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="single")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared", type=int, default=0, help="number of shared experts")
    p.add_argument("--path", default="auto", choices=["auto", "grouped_mm", "loop", "bmm"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=21)
    return p.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    result = LAYOUTS[args.layout](args)
    print(
        f"layout={args.layout} tokens={args.tokens} dim={args.dim} hidden={args.hidden} "
        f"experts={args.experts} top_k={args.top_k} shared={args.shared} dtype={args.dtype} "
        f"threads={args.threads} repeats={args.repeats}"
    )
    print(f"expert path: {result['path']}  rows per expert: {result['counts']}")
    print(f"step  (layer fwd+bwd, median): {result['step_ms']:8.2f} ms")
    print(f"floor (experts fwd+bwd, median): {result['floor_ms']:6.2f} ms")
    print(f"overhead (step - floor): {result['step_ms'] - result['floor_ms']:6.2f} ms")
    print(f"step / floor (median of per-repeat ratios): {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
