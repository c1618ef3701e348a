"""The one-pass combine and the group scores against the per-``k`` loops they replaced.

Shape legend: T tokens, D dim, K experts per token, R routed rows (``T * K``), E experts.

Three pieces of the MoE layer, each timed alternately with a *baseline*: the per-``k`` loop
written out here as the plain alternative (it lives only in this script):

- **combine**: ``y[t] = sum_k s[t, k] * out[row[t, k]]``. Package: ``weighted_row_sum``
  (``embedding_bag`` in ``"sum"`` mode, the scores as per-sample weights). Baseline: one
  gather and one ``addcmul`` per ``k``.
- **score gradient**: ``g[t] . out[row[t, k]]`` for every pair. Package:
  ``combine_score_grads`` (``embedding_bag``'s per-sample-weight gradient). Baseline: one
  gather and one ``vecdot`` per ``k``.
- **group scores** (group-limited routing): the sum of each group's two best scores. Package:
  ``max``, then ``amax`` with the best masked (inside ``_limit_to_top_groups``). Baseline:
  ``topk(2).values.sum(-1)``.

Each is timed warm (the largest difference of its result from the baseline's is printed: 0 for
the sums, float rounding for the dot products, whose terms are added in another order),
repeated on the same data, and, with ``--cold``, after writing a buffer
larger than the caches, as the layer meets its rows. Then the whole layer step (forward +
backward of ``MoE``) is timed with the package's helpers and with the baselines swapped in, in
alternating order in one process, and the median of per-step ``package / baseline`` ratios is
printed: what the pieces change in a step.

Run::

    python benchmarks/combine.py                              # E64, K8, H128, 1024 tokens
    python benchmarks/combine.py --experts 256 --hidden 64 --plain-routed-step
    python benchmarks/combine.py --cold
"""

# ruff: noqa: N806

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import dtensor_moe.moe.dispatch as dispatch_module
import dtensor_moe.moe.experts as experts_module
from dtensor_moe.moe import MoE, MoEConfig


def loop_weighted_row_sum(out_RD, row_TK, s_TK):
    """Baseline combine: one gather and one ``addcmul`` per ``k``."""
    y_TD = out_RD.index_select(0, row_TK[:, 0]).mul_(s_TK[:, :1])
    for k in range(1, row_TK.shape[1]):
        y_TD.addcmul_(out_RD.index_select(0, row_TK[:, k]), s_TK[:, k : k + 1])
    return y_TD


def loop_sum_rows(src_RD, row_TK):
    """Baseline token-gather backward: one gather and one ``add_`` per ``k``."""
    y_TD = src_RD.index_select(0, row_TK[:, 0])
    for k in range(1, row_TK.shape[1]):
        y_TD.add_(src_RD.index_select(0, row_TK[:, k]))
    return y_TD


def loop_combine_score_grads(grad_TD, out_RD, row_TK):
    """Baseline score gradient: one gather and one ``vecdot`` per ``k``."""
    return torch.stack(
        [torch.linalg.vecdot(grad_TD, out_RD.index_select(0, row_TK[:, k]))
         for k in range(row_TK.shape[1])],
        dim=1,
    )


PACKAGE = (
    dispatch_module.weighted_row_sum, dispatch_module.sum_rows, dispatch_module.combine_score_grads
)
BASELINE = (loop_weighted_row_sum, loop_sum_rows, loop_combine_score_grads)


def _use(helpers: tuple[Callable, ...]) -> None:
    """Point the package's modules at ``helpers`` (they import the names directly)."""
    for module in (dispatch_module, experts_module):
        module.weighted_row_sum, module.sum_rows, module.combine_score_grads = helpers


def _median_ms(fn: Callable[[], object], repeats: int, flush: torch.Tensor | None) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.fill_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _pieces(args: argparse.Namespace) -> None:
    T, K, D, E = args.tokens, args.top_k, args.dim, args.experts
    g = torch.Generator().manual_seed(0)
    out_RD = torch.randn(T * K, D, generator=g)
    row_TK = torch.randperm(T * K, generator=g).view(T, K)
    s_TK = torch.rand(T, K, generator=g)
    grad_TD = torch.randn(T, D, generator=g)
    groups = args.groups
    select_TGS = torch.rand(T, groups, E // groups, generator=g)
    # Larger than the last-level cache of common CPUs: the rows come from memory, as in a step.
    flush = torch.empty(2**24) if args.cold else None

    def group_scores():
        best, at = select_TGS.max(dim=-1, keepdim=True)
        return best.squeeze(-1) + select_TGS.scatter(-1, at, float("-inf")).amax(dim=-1)

    rows = [
        ("combine", lambda: PACKAGE[0](out_RD, row_TK, s_TK),
         lambda: loop_weighted_row_sum(out_RD, row_TK, s_TK)),
        ("token-gather backward", lambda: PACKAGE[1](out_RD, row_TK),
         lambda: loop_sum_rows(out_RD, row_TK)),
        ("score gradient", lambda: PACKAGE[2](grad_TD, out_RD, row_TK),
         lambda: loop_combine_score_grads(grad_TD, out_RD, row_TK)),
        (f"group scores ({groups} groups)", group_scores,
         lambda: select_TGS.topk(2, dim=-1).values.sum(-1)),
    ]
    print(f"pieces: T={T} K={K} D={D} E={E} fp32, {'cold' if args.cold else 'warm'} caches")
    for name, package, baseline in rows:
        p = _median_ms(package, args.repeats, flush)
        b = _median_ms(baseline, args.repeats, flush)
        diff = (package() - baseline()).abs().max().item() if T else 0.0
        print(f"  {name:28s} package {p:7.3f} ms  baseline {b:7.3f} ms  ratio {p / b:5.3f}"
              f"  max |difference| {diff:.1e}")


def _step(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(
        dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts, top_k=args.top_k,
        fused_routed_step=not args.plain_routed_step,
    ))
    x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    grad_y = torch.randn_like(x)

    def step() -> None:
        moe(x).backward(grad_y)

    times: dict[str, list[float]] = {"package": [], "baseline": []}
    try:
        for name, helpers in (("package", PACKAGE), ("baseline", BASELINE)) * 3:
            _use(helpers)
            step()  # warm-up
        for i in range(args.steps):
            order = [("package", PACKAGE), ("baseline", BASELINE)]
            for name, helpers in order if i % 2 else order[::-1]:
                _use(helpers)
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    finally:
        _use(PACKAGE)
    ratio = statistics.median(p / b for p, b in zip(times["package"], times["baseline"]))
    path = "plain" if args.plain_routed_step else "default (fused routed step)"
    print(f"layer step: E={args.experts} K={args.top_k} H={args.hidden} {path}, "
          f"{args.steps} alternating steps each")
    print(f"  package {1e3 * statistics.median(times['package']):.1f} ms, baseline "
          f"{1e3 * statistics.median(times['baseline']):.1f} ms, "
          f"package / baseline (median of per-step ratios): {ratio:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="expert groups for the group scores")
    p.add_argument("--plain-routed-step", action="store_true",
                   help="MoEConfig(fused_routed_step=False) for the layer step")
    p.add_argument("--cold", action="store_true", help="flush the caches before each piece")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per piece")
    p.add_argument("--steps", type=int, default=20, help="timed layer steps per variant")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.experts % args.groups or args.experts // args.groups < 2:
        p.error("--experts must be a multiple of --groups with at least 2 experts per group")
    torch.set_num_threads(args.threads)
    _pieces(args)
    _step(args)


if __name__ == "__main__":
    main()
