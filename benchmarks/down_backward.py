"""``swiglu_down``'s hand-written backward against torch's own ways to keep as little, side by side.

The expert math of one process at a preset's shape: the up projections (``h1``, ``h3``, the same
node in every variant), then the down projection with the combine weights. The variants of the
down step:

- ``ours``: :func:`dtensor_moe.routed.kernels.swiglu_down`, whose autograd formula keeps ``h1``,
  ``h3`` and the scores and recomputes the SwiGLU product (Note [The routed SwiGLU in two steps]);
- ``plain``: plain autograd on the same ops (keeps ``silu(h1)``, the product, the scaled side);
- ``sac-recompute``: the same ops under ``torch.utils.checkpoint`` with
  ``create_selective_checkpoint_contexts`` and a policy that recomputes every op: keeps what
  ``ours`` keeps, and runs the down projection again in backward;
- ``sac-save-down``: the same, with the down projection's output saved (``MUST_SAVE``), so it is
  not run again: keeps the ``R x D`` outputs.

Printed per variant: the median forward + backward time over alternating repeats, the median
of its per-repeat ratios to ``ours``, and the bytes the forward leaves alive for backward
(every tensor an op made during the forward, tracked by a ``TorchDispatchMode`` and counted by
storage if still alive after it; inputs and weights excluded, the output counted only if the
graph keeps it), so what ``checkpoint`` and its policy's cache hold is counted too. The
variants' gradients are checked against ours first. Run::

    python benchmarks/down_backward.py                       # qwen3 preset: H 96 <= D 256
    python benchmarks/down_backward.py --preset deepseek-v3  # H 64
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from dtensor_moe.routed.kernels import (
    _group_ends,
    _grouped_mm,
    _ProjectUp,
    _weighted_down,
    swiglu_down,
)

PRESETS = {  # benchmarks/moe_layer.py's presets, on the CPU widths
    "qwen3": dict(experts=128, top_k=8, hidden=96),
    "deepseek-v3": dict(experts=256, top_k=8, hidden=64),
}


def _plain_down(h1, h3, w2, offs, scores):
    h = F.silu(h1) * h3
    return _weighted_down(h, scores, lambda t: _grouped_mm(t, w2, offs), w2)


def _policy(save_down: bool):
    def policy(ctx, op, *args, **kwargs):
        if save_down and op is torch.ops.aten._grouped_mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _sac(save_down: bool):
    def down(h1, h3, w2, offs, scores):
        return checkpoint(_plain_down, h1, h3, w2, offs, scores, use_reentrant=False,
                          context_fn=_policy(save_down))  # fmt: skip

    return down


VARIANTS = {
    "ours": swiglu_down,
    "plain": _plain_down,
    "sac-recompute": _sac(save_down=False),
    "sac-save-down": _sac(save_down=True),
}


class _Made(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while active (a storage
    stays alive while any tensor on it does, a detached alias included)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


def _step(down, x, w1, w2, w3, offs, scores):
    h1, h3 = _ProjectUp.apply(x, w1, w3, offs)
    return down(h1, h3, w2, offs, scores)


def _kept_bytes(down, x, weights, offs, scores) -> int:
    mode = _Made()
    with mode:
        y = _step(down, x, *weights, offs, scores)
    node = y.grad_fn  # keeps the graph, and what it keeps, without the output itself
    del y
    skip = {t.untyped_storage().data_ptr() for t in (x, scores, *weights)}
    seen: dict[int, int] = {}
    gc.collect()
    for ref in mode.made:
        storage = ref()
        if storage is not None and storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    del node
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    p = PRESETS[args.preset]
    E, K, H, D = p["experts"], p["top_k"], p["hidden"], args.dim
    R = args.tokens * K
    counts = torch.bincount(torch.randint(0, E, (R,)), minlength=E)
    offs = _group_ends(counts)
    x = torch.randn(R, D, requires_grad=True)
    weights = [(torch.randn(s) * 0.05).requires_grad_() for s in ((E, H, D), (E, D, H), (E, H, D))]
    scores = torch.rand(R, requires_grad=True)
    grad = torch.randn(R, D)

    outs = {}
    for name, down in VARIANTS.items():  # the same gradients (up to float rounding)
        y = _step(down, x, *weights, offs, scores)
        outs[name] = torch.autograd.grad(y, [x, scores, *weights], grad)
    for name, got in outs.items():
        for a, b in zip(got, outs["ours"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for rep in range(args.warmup + args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            y = _step(VARIANTS[name], x, *weights, offs, scores)
            torch.autograd.grad(y, [x, scores, *weights], grad)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    print(f"preset={args.preset} R={R} D={D} H={H} E={E} fp32, one thread; "
          f"{args.repeats} repeats, alternating")  # fmt: skip
    for name in names:
        kept = _kept_bytes(VARIANTS[name], x, weights, offs, scores)
        med = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in zip(times[name], times["ours"], strict=True))
        print(f"{name:15s} step {med * 1e3:7.2f} ms  / ours {ratio:5.3f}  "
              f"kept for backward {kept / 2**20:6.2f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
