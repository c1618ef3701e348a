"""Grouped SwiGLU experts (routed) and the shared-expert MLP.

Shape legend:
    R  rows of the routed buffer, grouped by local expert (padding included)
    c  rows of one expert (``bmm``: the common count)
    D  model width
    H  hidden width of one expert
    I, O  input and output width of one grouped matmul
    e  experts whose weights this rank holds (all ``E`` without expert parallelism)
    T  tokens

Weight layout (``nn.Linear`` convention per expert, ``out x in``):
    ``w1`` (e, H, D) gate projection, ``w3`` (e, H, D) up projection, ``w2`` (e, D, H) down
    projection; expert ``i`` computes ``(silu(x @ w1[i].T) * (x @ w3[i].T)) @ w2[i].T``.
    Expert parallelism shards dim 0; expert tensor parallelism shards ``w1``/``w3`` on dim 1
    and ``w2`` on dim 2.

Note [Grouped experts on local weights]: :func:`grouped_swiglu` is a pure function of plain
tensors. The expert math reads the weights only through :meth:`GroupedExperts.local_weights`:
:meth:`GroupedExperts.compute` calls it and then :func:`grouped_swiglu`, and the expert-parallel
fast path (Note [Overlapped all-to-all] in ``dtensor_moe/parallel/dispatch.py``) calls it once
per forward. No parallel style wraps ``compute``; DTensor weights become their local ``e``
experts inside ``local_weights`` (below).

Note [Expert weights as DTensors]: a parallel style may turn ``w1``/``w2``/``w3`` into DTensors;
:meth:`GroupedExperts.compute` then runs on their local shards (:func:`local_expert_weight`).
The gradient placements are derived from the weight's own placements, never written per call:
on a mesh dim where the weight is sharded (``Shard(0)`` over experts, ``Shard(1)``/``Shard(2)``
over the hidden dim), the local gradient is the whole gradient of the local shard, because
every routed row that uses the shard reaches it (through the dispatcher's exchange, or because
the tokens are the same on every rank of that dim); so the gradient keeps the placement. On a
mesh dim where the weight is ``Replicate``, the ranks route different tokens, so the local
gradient is a partial sum over that dim: ``Partial``. A ``Partial`` weight is an error.

Note [What the experts save for backward]: on the default single-process path (local
dispatcher, no padding, scores in combine, ``grouped_mm``, ``fused_routed_step``),
:meth:`GroupedExperts.routed_step` runs the token gather, the SwiGLU and the combine as one
autograd node, :class:`_RoutedSwiGLU` (its SwiGLU steps: Note [SwiGLU steps on grouped_mm]).
Plain autograd over those steps saves the gathered rows (``R x D``), both pre-activations,
``silu(h1)`` and the product (``R x H`` each), and the expert outputs for the score gradient
(``T x K x D``). The node saves only what backward cannot cheaply rebuild:

* the gather's source ``x_TD`` (the router keeps it anyway) and the routing indices: backward
  gathers the rows again (one ``index_select``);
* the pre-activations ``h1 = x @ w1.T`` and ``h3 = x @ w3.T`` (``R x H`` each): backward
  recomputes ``silu(h1) * h3`` (elementwise). With ``recompute_experts=True`` not even those:
  backward recomputes them from the gathered rows, two more ``grouped_mm`` calls per backward
  (forward + backward then runs 12 expert matmuls, the plain path 9, the node otherwise 10),
  for the least memory;
* no expert outputs. Backward recomputes ``out = h @ w2.T`` with the forward's own
  ``grouped_mm`` call (one more grouped matmul per backward) for the score gradient.

Backward otherwise runs the plain path's autograd backward op for op: the combine's backward
(the same helpers, ``combine_row_grads`` and ``combine_score_grads`` in ``dispatch.py``: each
row's gradient is ``s * g`` by one gather, the score gradients one dot product per pair in one
pass), then ``grouped_mm``'s backward formulas, ``silu_backward``, and the permute's backward
(the ``K`` row gradients added in ``k`` order). So the output and every gradient are the same
bits as the plain path's (``tests/test_moe_memory.py``: ``torch.equal`` against
``fused_routed_step=False`` in float32 and bf16, with and without ``recompute_experts``).
``MoEConfig.fused_routed_step=False`` always takes the plain path. The other paths
(``loop``/``bmm``, padding, ``score_before_experts``, the plain expert-parallel path) keep plain
autograd; there ``recompute_experts`` checkpoints :meth:`GroupedExperts.compute` (its input is
all it keeps). Under ``torch.compile`` the layer takes the plain path and the compiler's
partitioner decides what to save. The expert-parallel one-node step saves the same way (Note
[Overlapped all-to-all] in ``dtensor_moe/parallel/dispatch.py``). ``benchmarks/moe_memory.py``
counts the bytes.
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from dtensor_moe import _compat
from dtensor_moe.moe.capacity import Capacity
from dtensor_moe.moe.config import ComputePath, DeviceLike, autocast_off, factory_kwargs
from dtensor_moe.moe.dispatch import (
    ExpertLayout,
    TokenDispatcher,
    combine_row_grads,
    combine_score_grads,
    sum_rows,
    weighted_row_sum,
)

__all__ = [
    "GroupedExperts",
    "SharedExperts",
    "grouped_swiglu",
    "local_expert_weight",
    "resolve_compute_path",
]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    Note [grouped_mm expanded grad]: in torch 2.13 the backward of ``torch._grouped_mm``
    raises "Invalid strides/sizes" when its upstream gradient is expanded (zero strides), as
    produced by ``y.sum().backward()``. Placing this identity right after every grouped_mm call
    hands it a contiguous gradient instead (free when it already is contiguous).
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# Note [grouped_mm under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.13's fake (meta) implementation of ``torch._grouped_mm`` accepts bf16 only, although
# the CPU kernel runs float32 too, so tracing a float32 layer stops with "Expected inputs of BF16
# type". While compiling, the grouped matmuls therefore go through two custom ops of our own,
# ``dtensor_moe::grouped_mm`` (``x_RI @ w_eOI[i].T`` per row group) and
# ``dtensor_moe::grouped_mm_weight_grad`` (``grad_RO[g].T @ x_RI[g]`` per group, the weight
# gradient), whose fakes give the output shapes and whose bodies call ``torch._grouped_mm``: the
# compiled graph runs the same kernel, with the same arguments, as eager autograd does
# (``tests/test_moe_compile.py`` checks outputs and gradients bit for bit against eager, and
# keeps a test that the plain op still fails to trace in float32). Eager calls
# ``torch._grouped_mm`` directly, with no custom-op overhead.


@torch.library.custom_op("dtensor_moe::grouped_mm", mutates_args=())
def _grouped_mm_op(x_RI: torch.Tensor, w_eOI: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_RI, w_eOI.transpose(-2, -1), offs=offs_e)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x_RI, w_eOI, offs_e):
    return x_RI.new_empty(x_RI.shape[0], w_eOI.shape[1])


@torch.library.custom_op("dtensor_moe::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(
    grad_RO: torch.Tensor, x_RI: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    return torch._grouped_mm(grad_RO.t(), x_RI, offs=offs_e)


@_grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_fake(grad_RO, x_RI, offs_e):
    return grad_RO.new_empty(offs_e.shape[0], grad_RO.shape[1], x_RI.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x_RI, w_eOI, offs_e = inputs
    ctx.save_for_backward(x_RI, w_eOI, offs_e)


def _grouped_mm_backward(ctx: Any, grad_RO: torch.Tensor) -> tuple:
    """The formulas of eager ``torch._grouped_mm``'s autograd (bit-identical results)."""
    x_RI, w_eOI, offs_e = ctx.saved_tensors
    grad_RO = grad_RO.contiguous()  # Note [grouped_mm expanded grad]
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = _grouped_mm_op(grad_RO, w_eOI.transpose(-2, -1), offs_e)
    if ctx.needs_input_grad[1]:
        grad_w = _grouped_mm_weight_grad(grad_RO, x_RI, offs_e)
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_mm(x_RI: torch.Tensor, w_eOI: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """``x_RI @ w_eOI[i].T`` per row group; see Note [grouped_mm expanded grad] and
    Note [grouped_mm under torch.compile]."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(x_RI, w_eOI, offs_e)
    return _ContiguousGrad.apply(torch._grouped_mm(x_RI, w_eOI.transpose(-2, -1), offs=offs_e))


# Note [Routed experts under autocast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.autocast`` casts ``mm``/``bmm``/``matmul`` to its lower-precision dtype but leaves
# ``torch._grouped_mm`` alone, so under autocast the ``loop`` and ``bmm`` paths would compute in
# bf16 and ``grouped_mm`` (and the fused routed step) in the weights' dtype, and the output's
# dtype would depend on which path the counts pick (``auto`` takes ``bmm`` when every expert
# gets the same count). The routed experts therefore run with autocast off for their device,
# in the weights' dtype, on every path: :func:`grouped_swiglu` (every path, also when called
# alone or per chunk by an expert-parallel dispatcher) and :meth:`GroupedExperts.forward` (the
# dispatcher's gather and combine, the fused step) each turn it off. The input must then have
# the weights' dtype (:meth:`GroupedExperts.forward` raises otherwise).


def _grouped_mm_supported(x_RD: torch.Tensor, w1_eHD: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs a supported dtype and 16-byte aligned row strides."""
    if x_RD.dtype not in _GROUPED_MM_DTYPES or x_RD.device.type not in ("cpu", "cuda"):
        return False
    _, H, D = w1_eHD.shape
    return (D * x_RD.element_size()) % 16 == 0 and (H * x_RD.element_size()) % 16 == 0


def _group_ends(counts_e: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` offsets: the int32 cumulative sum of the counts.

    Note [inductor cumsum dtype]: torch 2.13's inductor returns int64 from
    ``torch.cumsum(c, 0, dtype=torch.int32)`` when ``c`` is a constant it can fold (the static
    counts of ``pad_to_capacity``), and ``torch._grouped_mm`` then rejects the offsets. Summing
    in int64 and casting gives the same values and the right dtype on every backend;
    ``tests/test_capacity.py::test_inductor_cumsum_dtype_bug`` shows the workaround is needed.
    """
    return torch.cumsum(counts_e, 0).to(torch.int32)


def resolve_compute_path(
    path: ComputePath, x_RD: torch.Tensor, w1_eHD: torch.Tensor, counts: Sequence[int] | None
) -> str:
    """The concrete path for ``path`` (``"auto"`` or a forced one), validated.

    ``auto`` picks ``bmm`` when every expert has the same non-zero count, else ``grouped_mm``
    when supported (dtype, alignment), else ``loop``. ``counts`` are host ints, or ``None`` for
    device counts that should not be synchronised (then ``bmm`` is never chosen automatically).
    """
    if path == "auto":
        if counts is not None and len(set(counts)) == 1 and counts[0] > 0:
            return "bmm"
        return "grouped_mm" if _grouped_mm_supported(x_RD, w1_eHD) else "loop"
    if path == "grouped_mm" and not _grouped_mm_supported(x_RD, w1_eHD):
        _, H, D = w1_eHD.shape
        raise ValueError(
            f"compute_path='grouped_mm' needs dtype in {_GROUPED_MM_DTYPES} and dim/hidden_dim "
            f"rows of a multiple of 16 bytes; got dtype={x_RD.dtype}, dim={D}, hidden_dim={H}. "
            "Use compute_path='auto' or 'loop'"
        )
    if path == "bmm" and counts is not None and len(set(counts)) > 1:
        raise ValueError(
            f"compute_path='bmm' needs the same token count for every expert, got {list(counts)}; "
            "use compute_path='auto'"
        )
    if path not in ("grouped_mm", "loop", "bmm"):
        raise ValueError(f"unknown compute path {path!r}; use auto, grouped_mm, loop or bmm")
    return path


def _swiglu_grouped_mm(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    counts_e: torch.Tensor,
) -> torch.Tensor:
    offs_e = _group_ends(counts_e.to(x_RD.device))
    h_RH = F.silu(_grouped_mm(x_RD, w1_eHD, offs_e)) * _grouped_mm(x_RD, w3_eHD, offs_e)
    return _grouped_mm(h_RH, w2_eDH, offs_e)


def _swiglu_loop(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    counts: Sequence[int],
) -> torch.Tensor:
    outs = []
    for i, x_cD in enumerate(torch.split(x_RD, list(counts))):
        h_cH = F.silu(x_cD @ w1_eHD[i].T) * (x_cD @ w3_eHD[i].T)
        outs.append(h_cH @ w2_eDH[i].T)
    return torch.cat(outs)


def _swiglu_bmm(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    count: int,
) -> torch.Tensor:
    x_ecD = x_RD.view(w1_eHD.shape[0], count, x_RD.shape[-1])
    gate_ecH = torch.bmm(x_ecD, w1_eHD.transpose(1, 2))
    up_ecH = torch.bmm(x_ecD, w3_eHD.transpose(1, 2))
    return torch.bmm(F.silu(gate_ecH) * up_ecH, w2_eDH.transpose(1, 2)).reshape(x_RD.shape)


# Note [SwiGLU steps on grouped_mm]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The fused routed step (:class:`_RoutedSwiGLU`) and the expert-parallel one-node step
# (``_ExpertParallelStep`` in ``dtensor_moe/parallel/dispatch.py``) run the SwiGLU and its
# backward by hand, on ``torch._grouped_mm`` over row groups ending at ``offs``. They share
# the helpers below, which issue exactly the ops of :func:`grouped_swiglu`'s forward and of
# autograd's backward for it (``grouped_mm``'s formulas, ``silu_backward``) on each row group:
# the fused step gives the plain path's bits, and the expert-parallel step the plain math on
# its own and received rows (its combine differs from the plain exchange's only in rounding).
# The split into pieces lets each caller order them: the fused step reads the product for its
# score gradient before ``grad_w2``; the expert-parallel step finishes the received rows'
# input gradient and sends it before it computes their weight gradients, and runs the own
# rows' whole backward while the output gradients travel.


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` as it is, for the hand-written steps (no
    transpose of ``b`` and no autograd wrapper, unlike :func:`_grouped_mm`)."""
    return torch._grouped_mm(a, b, offs=offs)


def _swiglu_forward(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    offs: torch.Tensor,
    gate_RH: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Grouped SwiGLU of row groups ending at ``offs``: ``(out_RD, (gate_RH, up_RH))``.

    The pre-activations are what backward needs; :func:`_swiglu_saved` rebuilds the rest.
    ``gate_RH``: the gate projection, when the caller computed it earlier (Note [Overlapped
    all-to-all] in ``dtensor_moe/parallel/dispatch.py``).
    """
    if gate_RH is None:
        gate_RH = _gmm(x_RD, w1_eHD.transpose(-2, -1), offs)
    up_RH = _gmm(x_RD, w3_eHD.transpose(-2, -1), offs)
    h_RH = F.silu(gate_RH).mul_(up_RH)  # in place: one R x H buffer fewer, the same bits
    return _gmm(h_RH, w2_eDH.transpose(-2, -1), offs), (gate_RH, up_RH)


def _swiglu_saved(
    x_RD: torch.Tensor | None,
    hidden: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    offs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate_RH, up_RH, silu(gate_RH), h_RH)`` for the backward of :func:`_swiglu_forward`,
    from the saved pre-activations ``hidden``, or, when it is empty (``recompute_experts``),
    recomputed from the input ``x_RD`` by two ``grouped_mm`` calls; the forward's bits."""
    if hidden:
        gate_RH, up_RH = hidden
    else:
        w1_eHD, _, w3_eHD = weights
        gate_RH = _gmm(x_RD, w1_eHD.transpose(-2, -1), offs)
        up_RH = _gmm(x_RD, w3_eHD.transpose(-2, -1), offs)
    act_RH = F.silu(gate_RH)
    return gate_RH, up_RH, act_RH, act_RH * up_RH


def _w2_grad(grad_RD: torch.Tensor, saved: tuple[torch.Tensor, ...], offs) -> torch.Tensor:
    """``grad_w2`` of :func:`_swiglu_forward` (``saved`` from :func:`_swiglu_saved`)."""
    return _gmm(grad_RD.t(), saved[3], offs)


def _gate_up_grads(
    grad_RD: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    w2_eDH: torch.Tensor,
    offs: torch.Tensor,
    product_dead: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-activations' gradients ``(grad_gate_RH, grad_up_RH)`` of
    :func:`_swiglu_forward`. ``product_dead``: the caller is done with the product
    (``saved[3]``: :func:`_w2_grad` and any score gradient have read it), whose buffer then
    takes the gate's gradient (Note [Scratch buffers of the fused step])."""
    gate_RH, up_RH, act_RH, h_RH = saved
    grad_h_RH = _gmm(grad_RD, w2_eDH, offs)
    grad_gate_RH = torch.mul(grad_h_RH, up_RH, out=h_RH if product_dead else None)
    torch.ops.aten.silu_backward.grad_input(grad_gate_RH, gate_RH, grad_input=grad_gate_RH)
    return grad_gate_RH, grad_h_RH.mul_(act_RH)


def _x_grad(
    grad_gate_RH: torch.Tensor, grad_up_RH: torch.Tensor, weights: tuple, offs: torch.Tensor
) -> torch.Tensor:
    """The input's gradient of :func:`_swiglu_forward`, from :func:`_gate_up_grads`."""
    w1_eHD, _, w3_eHD = weights
    return _gmm(grad_gate_RH, w1_eHD, offs).add_(_gmm(grad_up_RH, w3_eHD, offs))


def _w13_grads(
    x_RD: torch.Tensor | None,
    grad_gate_RH: torch.Tensor,
    grad_up_RH: torch.Tensor,
    offs: torch.Tensor,
    need: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_w1, grad_w3)`` of :func:`_swiglu_forward`; ``need`` skips either (``None``)."""
    return (
        _gmm(grad_gate_RH.t(), x_RD, offs) if need[0] else None,
        _gmm(grad_up_RH.t(), x_RD, offs) if need[1] else None,
    )


# Note [Scratch buffers of the fused step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The fused step's backward rebuilds what its forward did not keep: the gathered rows, the
# SwiGLU product and the expert outputs. Each rebuild written into a fresh tensor costs a fresh
# allocation, and on CPU glibc hands big ones fresh pages (page faults on every step; see "The
# CPU allocator" in docs/benchmarks.md). So the gathered rows go into the expert outputs' buffer
# once the score gradients have read it (without ``recompute_experts``, and when the scores
# need a gradient; otherwise the rows are gathered fresh, and only when a weight gradient needs
# them), the gate's gradient (``grad_h * h3``, then ``silu_backward`` in place) into the SwiGLU
# product's buffer once ``grad_w2`` has read it, and the forward's product is made in place:
# the same ops on the same values, so the same bits, with fewer fresh buffers.
# ``torch._grouped_mm`` has no ``out=``, so its results stay fresh.


class _RoutedSwiGLU(torch.autograd.Function):
    """Token gather, grouped SwiGLU and combine as one node; Note [What the experts save for
    backward]. ``forward(x_TD, scores_TK, w1, w2, w3, token_N, order_N, row_TK, offs_e,
    recompute)`` returns ``y_TD``; no padding (``R == N``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        w1_eHD: torch.Tensor,
        w2_eDH: torch.Tensor,
        w3_eHD: torch.Tensor,
        token_N: torch.Tensor,
        order_N: torch.Tensor,
        row_TK: torch.Tensor,
        offs_e: torch.Tensor,
        recompute: bool,
    ) -> torch.Tensor:
        x_RD = x_TD.index_select(0, token_N)
        out_RD, hidden = _swiglu_forward(x_RD, w1_eHD, w2_eDH, w3_eHD, offs_e)
        del x_RD
        y_TD = weighted_row_sum(out_RD, row_TK, scores_TK.to(x_TD.dtype))
        del out_RD
        ctx.save_for_backward(
            x_TD, scores_TK, w1_eHD, w2_eDH, w3_eHD, token_N, order_N, row_TK, offs_e,
            *(() if recompute else hidden),
        )  # fmt: skip
        return y_TD

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # Note [Double backward] in dispatch.py
            raise RuntimeError(
                "the MoE layer's fused routed step cannot be differentiated twice "
                "(backward with create_graph=True, for a gradient penalty or a Hessian-vector "
                "product); build the layer with MoEConfig(fused_routed_step=False), whose "
                "plain path supports it, with the same first-order results"
            )
        x_TD, scores_TK, w1_eHD, w2_eDH, w3_eHD, token_N, order_N, row_TK, offs_e, *hidden = (
            ctx.saved_tensors
        )
        T, K = row_TK.shape
        weights = (w1_eHD, w2_eDH, w3_eHD)
        # Note [Scratch buffers of the fused step]: dead buffers are written again (``out=``,
        # in place) rather than fresh ones allocated; the values and bits are the same.
        x_RD = None if hidden else x_TD.index_select(0, token_N)
        saved = _swiglu_saved(x_RD, tuple(hidden), weights, offs_e)
        need = ctx.needs_input_grad
        # The plain combine's backward, op for op (Note [What the experts save for backward]).
        s_TK = scores_TK.to(x_TD.dtype)
        grad_RD = combine_row_grads(grad_TD, s_TK, row_TK, T * K, order_N)
        grad_scores_TK, scratch_RD = None, None
        if need[1]:
            # out_RD again, by the forward's own call: the plain path's saved expert outputs.
            scratch_RD = _gmm(saved[3], w2_eDH.transpose(-2, -1), offs_e)
            grad_scores_TK = combine_score_grads(grad_TD, scratch_RD, row_TK).to(scores_TK.dtype)
        if x_RD is None and (need[2] or need[4]):  # the token gather again, into the dead
            x_RD = torch.index_select(x_TD, 0, token_N, out=scratch_RD)  # outputs if any
        del scratch_RD
        grad_w2 = _w2_grad(grad_RD, saved, offs_e) if need[3] else None
        grad_gate_RH, grad_up_RH = _gate_up_grads(grad_RD, saved, w2_eDH, offs_e, product_dead=True)
        del grad_RD, saved
        grad_w1, grad_w3 = _w13_grads(x_RD, grad_gate_RH, grad_up_RH, offs_e, (need[2], need[4]))
        grad_x_TD = None
        if need[0]:
            grad_x_TD = sum_rows(_x_grad(grad_gate_RH, grad_up_RH, weights, offs_e), row_TK)
        return grad_x_TD, grad_scores_TK, grad_w1, grad_w2, grad_w3, *(None,) * 5


def grouped_swiglu(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    counts_e: torch.Tensor | Sequence[int],
    path: ComputePath = "auto",
) -> torch.Tensor:
    """SwiGLU of each row group with its expert's weights: plain tensors in, ``(R, D)`` out.

    Rows ``[c_0 + ... + c_{i-1}, c_0 + ... + c_i)`` go to expert ``i``; ``counts_e`` must sum
    to ``R``. All paths give the same result (up to float rounding for ``bmm``). ``counts_e``
    is read on the host for ``auto`` and ``loop``/``bmm``, unless it is a tensor on an
    accelerator, where ``auto`` keeps it there and picks ``grouped_mm``. ``torch.autocast`` does
    not apply: every path computes in the weights' dtype (Note [Routed experts under
    autocast]).
    """
    e = w1_eHD.shape[0]
    if len(counts_e) != e:
        raise ValueError(f"counts_e has {len(counts_e)} entries but the weights hold {e} experts")
    if torch.compiler.is_compiling() and not (
        path in ("auto", "grouped_mm") and _grouped_mm_supported(x_RD, w1_eHD)
    ):
        return _host_count_paths(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path)
    with autocast_off(x_RD):
        return _swiglu_on_path(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path)


def _swiglu_on_path(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path) -> torch.Tensor:
    """:func:`grouped_swiglu` after its checks: resolve the path and run it."""
    counts = _host_counts(counts_e, path)
    chosen = resolve_compute_path(path, x_RD, w1_eHD, counts)
    if chosen != "grouped_mm" and counts is None:
        counts = counts_e.tolist()
        chosen = resolve_compute_path(chosen, x_RD, w1_eHD, counts)
    if counts is not None and sum(counts) != x_RD.shape[0]:
        raise ValueError(f"counts_e sums to {sum(counts)} but x_RD has {x_RD.shape[0]} rows")
    if chosen == "grouped_mm":
        if not isinstance(counts_e, torch.Tensor):
            counts_e = torch.tensor(counts, dtype=torch.int64)
        return _swiglu_grouped_mm(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e)
    if chosen == "bmm":
        return _swiglu_bmm(x_RD, w1_eHD, w2_eDH, w3_eHD, counts[0])
    return _swiglu_loop(x_RD, w1_eHD, w2_eDH, w3_eHD, counts)


_HOST_COUNTS_REASON = (
    "the loop and bmm expert paths (compute_path='loop'/'bmm', or 'auto' when torch._grouped_mm "
    "does not support the dtype or the row alignment) split the rows by counts read on the "
    "host, so they run eagerly: one graph break. compute_path='auto' or 'grouped_mm' with "
    "float32/bf16 and dim, hidden_dim rows of a multiple of 16 bytes keeps the experts in the graph"
)


def _host_count_paths(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path) -> torch.Tensor:
    """:func:`grouped_swiglu` on a path that reads the counts on the host, run eagerly while
    compiling (one graph break, Note [MoE under torch.compile] in ``layer.py``) instead of
    tracing one break per host read and recompiling for every new set of counts."""
    return grouped_swiglu(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path)


_host_count_paths = torch.compiler.disable(_host_count_paths, reason=_HOST_COUNTS_REASON)


def _host_counts(counts_e: torch.Tensor | Sequence[int], path: ComputePath) -> list[int] | None:
    """Counts as host ints, or ``None`` to leave the counts on the device unread: accelerator
    counts, and any counts while ``torch.compile`` traces (a host read is a graph break; see
    Note [MoE under torch.compile] in ``layer.py``), for ``auto`` and ``grouped_mm``."""
    if not isinstance(counts_e, torch.Tensor):
        return [int(c) for c in counts_e]
    if path in ("auto", "grouped_mm") and (
        counts_e.device.type != "cpu" or torch.compiler.is_compiling()
    ):
        return None
    return counts_e.tolist()


def local_expert_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, or the local shard of a DTensor ``w`` with derived gradient placements.

    See Note [Expert weights as DTensors]. No collective runs in forward or in backward.
    """
    if not isinstance(w, DTensor):
        return w
    _check_not_partial(w)
    return w.to_local(grad_placements=list(_grad_placements(w)))


def _check_not_partial(w: DTensor) -> None:
    if any(p.is_partial() for p in w.placements):
        raise ValueError(
            f"routed expert weights must be Shard or Replicate DTensors, got {w.placements}; "
            "redistribute the weight or re-apply the parallel style"
        )


def _grad_placements(w: DTensor) -> tuple:
    """See Note [Expert weights as DTensors]: ``Replicate`` dims give ``Partial`` gradients."""
    return tuple(Partial() if p.is_replicate() else p for p in w.placements)


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts with stacked weights and the token dispatcher that feeds them.

    Keyword Args:
        dim: ``D``.
        hidden_dim: ``H`` of each expert.
        num_experts: ``E``.
        compute_path: see :func:`grouped_swiglu`.
        recompute_experts: keep only the experts' input for backward and recompute the rest
            there (Note [What the experts save for backward]).
        fused_routed_step: let the local dispatcher run gather, experts and combine as one
            autograd node (:meth:`routed_step`); ``False`` always takes the plain path. Both
            give the same bits.
        dispatcher: a :class:`TokenDispatcher` (default: local, no padding, scores in combine).
            Parallel styles replace it with a communicating subclass.
        init_std: std of the normal weight initialisation.
        device, dtype: where and in which floating dtype the weights are made (torch's factory
            arguments; ``None``: torch's defaults).

    Forward: ``(x_TD, topk_scores_TK, topk_ids_TK, counts_E) -> y_TD``. The collectives are
    the dispatcher's; this module adds none.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        compute_path: ComputePath = "auto",
        dispatcher: TokenDispatcher | None = None,
        init_std: float = 0.02,
        recompute_experts: bool = False,
        fused_routed_step: bool = True,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = factory_kwargs(device, dtype)
        if not isinstance(recompute_experts, bool):
            raise TypeError(f"recompute_experts must be a bool, got {recompute_experts!r}")
        if not isinstance(fused_routed_step, bool):
            raise TypeError(f"fused_routed_step must be a bool, got {fused_routed_step!r}")
        self.compute_path = compute_path
        self.recompute_experts = recompute_experts
        self.fused_routed_step = fused_routed_step
        self.init_std = init_std
        self.dispatcher = (
            dispatcher if dispatcher is not None else TokenDispatcher(num_experts=num_experts)
        )
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=self.init_std)

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> torch.Tensor:
        if x_TD.dtype != self.w1.dtype:  # after this module's own hooks (an FSDP unit's cast)
            raise ValueError(
                f"the routed experts got input of dtype={x_TD.dtype} but their weights are "
                f"{self.w1.dtype}; cast the input or the layer so that they match (for "
                "example moe.to(torch.bfloat16)). torch.autocast does not apply to the routed "
                "experts: they run in the weights' dtype, and need an input of it"
            )
        args = () if capacity is None else (capacity,)
        with autocast_off(x_TD):  # Note [Routed experts under autocast]
            return self.dispatcher.run_experts(
                self, x_TD, topk_scores_TK, topk_ids_TK, counts_E, *args
            )

    def runs_eagerly_under_compile(
        self, x_TD: torch.Tensor, capacity: Capacity | None = None
    ) -> bool:
        """Whether :meth:`forward` on ``x_TD`` reads counts or exchange sizes on the host, and
        so runs (in part) eagerly while ``torch.compile`` traces: the dispatcher says so (an
        expert-parallel exchange, ``pad_multiple > 1``, a capacity without padding), or the
        compute path is ``loop``/``bmm`` (forced, or ``auto`` where ``torch._grouped_mm``
        does not take the dtype or the row alignment). An :class:`~dtensor_moe.moe.MoE` then
        calls this module eagerly as a whole (Note [Eager islands under torch.compile] in
        ``layer.py``)."""
        ask = getattr(self.dispatcher, "runs_eagerly_under_compile", None)  # a duck-typed one
        if ask is not None and ask(capacity):
            return True
        grouped = self.compute_path in ("auto", "grouped_mm")
        return not (grouped and _grouped_mm_supported(x_TD, local_expert_weight(self.w1)))

    def compute(self, routed_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Expert math on the routed buffer; see Note [Grouped experts on local weights].

        DTensor weights are used through their local shards (Note [Expert weights as DTensors]).
        With ``recompute_experts``, the call is checkpointed: backward recomputes it from
        ``routed_RD`` (Note [What the experts save for backward]).
        """
        weights = self.local_weights()
        if (
            self.recompute_experts
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            return torch.utils.checkpoint.checkpoint(
                grouped_swiglu, routed_RD, *weights, counts_e, self.compute_path,
                use_reentrant=False,
            )
        return grouped_swiglu(routed_RD, *weights, counts_e, self.compute_path)

    def routed_step(
        self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, layout: ExpertLayout
    ) -> torch.Tensor | None:
        """Gather, experts and combine of a local dispatch as one node, or ``None``.

        ``y_TD[t] = sum_k topk_scores_TK[t, k] * experts(x_TD[t])_k`` for the rows of
        ``layout`` (no padding), saving what Note [What the experts save for backward] says.
        ``None`` when the compute path is not ``grouped_mm`` (or while compiling): the caller
        then runs dispatch, :meth:`compute` and combine. No collective.
        """
        if (
            not self.fused_routed_step
            or layout.row_N is not None
            or torch.compiler.is_compiling()
        ):
            return None
        w1, w2, w3 = self.local_weights()
        if w1.shape[0] != len(layout.counts_e) or x_TD.dtype != w1.dtype:
            return None  # the plain path raises the error
        counts = _host_counts(layout.counts_e, self.compute_path)
        if resolve_compute_path(self.compute_path, x_TD, w1, counts) != "grouped_mm":
            return None
        offs_e = _group_ends(layout.counts_e.to(x_TD.device))
        return _RoutedSwiGLU.apply(
            x_TD, topk_scores_TK, w1, w2, w3, layout.token_N, layout.order_N, layout.row_TK,
            offs_e, self.recompute_experts,
        )

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w2, w3)`` as plain tensors: the local shards of DTensor weights.

        A dispatcher that computes several row chunks (to overlap them with communication) calls
        this once and :func:`grouped_swiglu` per chunk. See Note [Expert weights as DTensors].
        """
        ws = (self.w1, self.w2, self.w3)
        if all(isinstance(w, DTensor) for w in ws):
            for w in ws:
                _check_not_partial(w)
            return _compat.local_views(ws, tuple(_grad_placements(w) for w in ws))
        w1, w2, w3 = (local_expert_weight(w) for w in ws)
        return w1, w2, w3

    def extra_repr(self) -> str:
        E, H, D = self.w1.shape
        return (
            f"num_experts={E}, dim={D}, hidden_dim={H}, compute_path={self.compute_path!r}, "
            f"recompute_experts={self.recompute_experts}, "
            f"fused_routed_step={self.fused_routed_step}, dispatcher={self.dispatcher!r}"
        )


class SharedExperts(nn.Module):
    """Always-on SwiGLU MLP: ``n`` shared experts of hidden ``h`` fused into one of ``n * h``.

    Fusing is exact: the sum of ``n`` SwiGLU experts equals one SwiGLU whose hidden units are
    their concatenation. With ``gated=True`` (``MoEConfig.shared_expert_gate``) the output is
    scaled per token by ``sigmoid(x @ gate.weight.T)``, ``gate`` an ``nn.Linear(dim, 1)`` without
    bias (Qwen2-MoE). No collective runs here. ``x_TD`` may have any leading shape
    ``(..., dim)``. ``device`` and ``dtype`` are torch's factory arguments for the weights.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        init_std: float = 0.02,
        gated: bool = False,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = factory_kwargs(device, dtype)
        self.init_std = init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, **factory)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.gate = nn.Linear(dim, 1, bias=False, **factory) if gated else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3, self.gate):
            if lin is not None:
                nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``(silu(x @ w1.T) * (x @ w3.T)) @ w2.T``, times ``sigmoid(x @ gate.T)`` when gated,
        through the ``w1``/``w2``/``w3``/``gate`` modules, so that their hooks and adapter swaps
        apply (Note [One forward] in ``tokens.py``)."""
        y_TD = self.w2(F.silu(self.w1(x_TD)) * self.w3(x_TD))
        return y_TD if self.gate is None else torch.sigmoid(self.gate(x_TD)) * y_TD
