"""The routed experts' math: grouped SwiGLU on plain tensors, on every compute path.

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

Note [What the experts save for backward]: the two-step memory strategy (``experts.py``) on the
``grouped_mm`` path keeps the source of the rows (``x_TD``, which the router keeps anyway, or
the rows an exchange received), the two pre-activations ``h1``/``h3`` and ``O(R)`` indices and
scores, through torch's saved-tensor hooks and one fused op (Note [The routed SwiGLU in two
steps]). ``recompute_experts=True`` keeps only the source. The other paths
(``fused_routed_step=False``, ``loop``/``bmm``, ``score_before_experts``) run plain autograd;
there ``recompute_experts`` checkpoints the expert math (its input is all it keeps).
``benchmarks/moe_memory.py`` counts the bytes.
"""

# ruff: noqa: N803, N806, N812

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from dtensor_moe.moe.config import ComputePath, autocast_off
from dtensor_moe.routed.layouts import ExpertLayout, permute_tokens

__all__ = ["grouped_swiglu", "resolve_compute_path", "swiglu_down"]

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


# Note [grouped_mm expanded grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In torch 2.13 the backward of ``torch._grouped_mm`` raises "Invalid strides/sizes" when its
# upstream gradient is expanded (zero strides), as ``y.sum().backward()`` produces. Every eager
# grouped_mm output that requires grad therefore gets a tensor hook that hands its node a
# contiguous gradient (free when it already is contiguous); hooks also run under ``torch.func``
# transforms and in a double backward.


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
    return *_gmm_grads(grad_RO, *ctx.saved_tensors, *ctx.needs_input_grad[:2]), None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_mm(x_RI: torch.Tensor, w_eOI: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """``x_RI @ w_eOI[i].T`` per row group; see Note [grouped_mm expanded grad] and
    Note [grouped_mm under torch.compile]."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(x_RI, w_eOI, offs_e)
    out_RO = torch._grouped_mm(x_RI, w_eOI.transpose(-2, -1), offs=offs_e)
    if out_RO.requires_grad:  # Note [grouped_mm expanded grad]
        out_RO.register_hook(torch.Tensor.contiguous)
    return out_RO


# Note [Routed experts under autocast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.autocast`` casts ``mm``/``bmm``/``matmul`` to its lower-precision dtype but leaves
# ``torch._grouped_mm`` alone, so under autocast the ``loop`` and ``bmm`` paths would compute in
# bf16 and ``grouped_mm`` (and the fused routed step) in the weights' dtype, and the output's
# dtype would depend on which path the counts pick (``auto`` takes ``bmm`` when every expert
# gets the same count). The routed experts therefore run with autocast off for their device,
# in the weights' dtype, on every path: :func:`grouped_swiglu` (every path, also when called
# alone) and :meth:`GroupedExperts.forward` (the exchange's gather and combine, the fused step)
# each turn it off. The input must then have
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
    scores_R: torch.Tensor | None = None,
) -> torch.Tensor:
    offs_e = _group_ends(counts_e.to(x_RD.device))
    h_RH = F.silu(_grouped_mm(x_RD, w1_eHD, offs_e)) * _grouped_mm(x_RD, w3_eHD, offs_e)
    return _weighted_down(h_RH, scores_R, lambda h: _grouped_mm(h, w2_eDH, offs_e), w2_eDH)


def _weighted_down(
    h_RH: torch.Tensor,
    scores_R: torch.Tensor | None,
    down: Callable,
    w2_eDH: torch.Tensor,
    in_place: bool = False,
) -> torch.Tensor:
    """``down(h_RH)``, each row scaled by its combine weight (``None``: unscaled): the products
    before the down projection where they are the narrower (``H <= D``), else the outputs after
    it (Note [The routed SwiGLU in two steps]). ``in_place``: scale ``h_RH`` or the output in
    place (outside autograd; the same bits)."""
    if scores_R is None:
        return down(h_RH)
    s, mul = scores_R.unsqueeze(-1), (torch.Tensor.mul_ if in_place else torch.mul)
    return down(mul(h_RH, s)) if h_RH.shape[-1] <= w2_eDH.shape[1] else mul(down(h_RH), s)


def _swiglu_loop(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    counts: Sequence[int],
    scores_R: torch.Tensor | None = None,
) -> torch.Tensor:
    outs = []
    scores = [None] * len(counts) if scores_R is None else torch.split(scores_R, list(counts))
    for i, (x_cD, s_c) in enumerate(zip(torch.split(x_RD, list(counts)), scores, strict=True)):
        h_cH = F.silu(x_cD @ w1_eHD[i].T) * (x_cD @ w3_eHD[i].T)
        outs.append(_weighted_down(h_cH, s_c, lambda h: h @ w2_eDH[i].T, w2_eDH))
    return torch.cat(outs)


def _swiglu_bmm(
    x_RD: torch.Tensor,
    w1_eHD: torch.Tensor,
    w2_eDH: torch.Tensor,
    w3_eHD: torch.Tensor,
    count: int,
    scores_R: torch.Tensor | None = None,
) -> torch.Tensor:
    e = w1_eHD.shape[0]
    x_ecD = x_RD.view(e, count, x_RD.shape[-1])
    gate_ecH = torch.bmm(x_ecD, w1_eHD.transpose(1, 2))
    up_ecH = torch.bmm(x_ecD, w3_eHD.transpose(1, 2))
    scores_ec = None if scores_R is None else scores_R.view(e, count)
    out_ecD = _weighted_down(F.silu(gate_ecH) * up_ecH, scores_ec,
                             lambda h: torch.bmm(h, w2_eDH.transpose(1, 2)), w2_eDH)
    return out_ecD.reshape(x_RD.shape)


# Note [The routed SwiGLU in two steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the ``grouped_mm`` path, :meth:`GroupedExperts.compute` runs the experts as two steps:
#
# 1. the up projections, ``h1 = rows @ w1.T`` and ``h3 = rows @ w3.T``, where ``rows`` is the
#    row gather of the source (``permute_tokens``), as one autograd node (:class:`_ProjectUp`,
#    which adds the two input gradients in place). A ``saved_tensors_hooks`` pair keeps, in
#    place of the ``R x D`` gathered rows that node saves, their source and layout
#    (:class:`_Regather`): backward gathers them again. The source is held anyway (by the
#    router, or as the rows an exchange received);
# 2. :func:`swiglu_down`, one node, ``(s * silu(h1) * h3) @ w2.T``: the SwiGLU product, the
#    row's combine weight and the down projection. The weight scales the narrower of the
#    ``R x H`` product and the ``R x D`` output (``s * ((silu(h1) * h3) @ w2.T)`` where
#    ``H > D``; :func:`_weighted_down`, which the plain path runs too). Its autograd formula
#    keeps ``h1``, ``h3`` and the scores, recomputes ``silu(h1) * h3`` (elementwise), and gets
#    the score gradient from the down projection's input gradient (``rowdot(g @ w2, h)``).
#
# Forward and backward then run 9 grouped matmuls, as plain autograd does, and keep the source,
# ``h1``, ``h3`` and ``O(R)`` indices and scores. Every backward may run more than once
# (``retain_graph``, the input and weight phases of a zero-bubble schedule) and be differentiated
# again (``create_graph``: the formula is made of differentiable ops in eager mode).
# ``recompute_experts=True`` checkpoints both steps (``torch.utils.checkpoint``): only the source
# is kept, and backward runs both steps again (12 grouped matmuls: the down projection's
# saved inputs are packed after it runs, so checkpoint's early stop comes after it).
# ``fused_routed_step=False`` runs plain autograd on the same math (the scores scale the same
# side of the down projection: the same output bits). Under ``torch.func`` transforms
# (which run no custom-op formula and no saved-tensor hook) the experts take the plain path, and
# while compiling the rows are saved as they are (the partitioner decides what to keep); the
# results are the same up to float rounding.


def _gmm_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grad_RO[g].T @ x_RI[g]`` per row group: a weight's gradient."""
    if torch.compiler.is_compiling():
        return _grouped_mm_weight_grad(grad_RO, x_RI, offs)
    return torch._grouped_mm(grad_RO.t(), x_RI, offs=offs)


def _gmm_grads(grad_RO, x_RI, w_eOI, offs_e, need_x: bool, need_w: bool) -> tuple:
    """The gradients of ``x_RI @ w_eOI[i].T`` per row group for ``x_RI`` and ``w_eOI`` (``None``
    where not needed), with the formulas of eager ``torch._grouped_mm``'s autograd (the same
    bits)."""
    grad_RO = grad_RO.contiguous()  # Note [grouped_mm expanded grad]
    grad_x = _grouped_mm(grad_RO, w_eOI.transpose(-2, -1), offs_e) if need_x else None
    return grad_x, (_gmm_weight_grad(grad_RO, x_RI, offs_e) if need_w else None)


def _swiglu_down_body(
    h1_RH: torch.Tensor,
    h3_RH: torch.Tensor,
    w2_eDH: torch.Tensor,
    offs_e: torch.Tensor,
    scores_R: torch.Tensor | None,
) -> torch.Tensor:
    h_RH = F.silu(h1_RH).mul_(h3_RH)
    w2_eHD = w2_eDH.transpose(-2, -1)
    return _weighted_down(h_RH, scores_R, lambda h: torch._grouped_mm(h, w2_eHD, offs=offs_e),
                          w2_eDH, in_place=True)  # fmt: skip


_swiglu_down_op = torch.library.custom_op("dtensor_moe::swiglu_down", mutates_args=())(
    _swiglu_down_body
)


@_swiglu_down_op.register_fake
def _swiglu_down_fake(h1_RH, h3_RH, w2_eDH, offs_e, scores_R):
    return h1_RH.new_empty(h1_RH.shape[0], w2_eDH.shape[1])


def _swiglu_down_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_down_backward(ctx: Any, grad_RD: torch.Tensor) -> tuple:
    h1, h3, w2, offs, s = ctx.saved_tensors
    g = grad_RD.contiguous()  # Note [grouped_mm expanded grad]
    # products of fresh tensors are taken in place unless a graph is being built
    mul = torch.mul if torch.is_grad_enabled() else torch.Tensor.mul_
    act = F.silu(h1)
    h = act * h3
    u = _grouped_mm(g, w2.transpose(-2, -1), offs)  # g @ w2[e]: before the scores
    grad_s = None if s is None or not ctx.needs_input_grad[4] else (u * h).sum(-1)
    # the scores scale u and, for grad_w2, the one of h (R x H) and g (R x D) that the forward
    # scaled (the narrower): (s * g).T @ h == g.T @ (s * h)
    if s is not None:
        u = mul(u, s[:, None])
        h, g = (mul(h, s[:, None]), g) if h.shape[1] <= g.shape[1] else (h, g * s[:, None])
    grad_w2 = _gmm_weight_grad(g, h, offs) if ctx.needs_input_grad[2] else None
    if torch.is_grad_enabled():  # create_graph: silu_backward has no derivative
        sig = torch.sigmoid(h1)
        grad_h1 = u * h3 * (sig * (1 + h1 * (1 - sig)))
    else:
        grad_h1 = torch.ops.aten.silu_backward(u * h3, h1)
    return grad_h1, mul(u, act), grad_w2, None, grad_s


_swiglu_down_op.register_autograd(_swiglu_down_backward, setup_context=_swiglu_down_setup)


class _SwigluDown(torch.autograd.Function):
    """The op ``dtensor_moe::swiglu_down`` in eager mode: its body and formula, without the
    custom op's dispatch (about 30 us a call on CPU)."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(*inputs)
        return _swiglu_down_body(*inputs)

    @staticmethod
    def backward(ctx: Any, grad_RD: torch.Tensor) -> tuple:
        return _swiglu_down_backward(ctx, grad_RD)


def swiglu_down(h1_RH, h3_RH, w2_eDH, offs_e, scores_R: torch.Tensor | None) -> torch.Tensor:
    """``(scores_R[:, None] * silu(h1_RH) * h3_RH) @ w2_eDH[i].T`` per row group ending at
    ``offs_e``; ``scores_R=None``: unscaled. Note [The routed SwiGLU in two steps]. While
    compiling it is the op ``dtensor_moe::swiglu_down`` (registered with ``torch.library``);
    in eager mode an autograd Function with the same body and formula."""
    if torch.compiler.is_compiling():
        return _swiglu_down_op(h1_RH, h3_RH, w2_eDH, offs_e, scores_R)
    return _SwigluDown.apply(h1_RH, h3_RH, w2_eDH, offs_e, scores_R)


class _Regather:
    """What a saved-tensor hook keeps instead of the gathered rows: their source and layout.
    Each backward that unpacks them (a second one with ``retain_graph``, the weight phase of a
    zero-bubble schedule) gathers them again; in grad mode (``create_graph``) the gather is part
    of the new graph."""

    __slots__ = ("source", "layout")

    def __init__(self, source: torch.Tensor, layout: ExpertLayout) -> None:
        self.source, self.layout = source, layout

    def get(self) -> torch.Tensor:
        return permute_tokens(self.source, self.layout)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.get() if isinstance(saved, _Regather) else saved


class _ProjectUp(torch.autograd.Function):
    """``(x_RD @ w1_eHD[i].T, x_RD @ w3_eHD[i].T)`` per row group ending at ``offs_e``, as one
    node: the rows are saved once, and backward adds the two input gradients in place (autograd
    would run two nodes and add their results into a third tensor). Eager mode only."""

    @staticmethod
    def forward(ctx: Any, x_RD, w1_eHD, w3_eHD, offs_e) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x_RD, w1_eHD, w3_eHD, offs_e)
        return tuple(torch._grouped_mm(x_RD, w.transpose(-2, -1), offs=offs_e)
                     for w in (w1_eHD, w3_eHD))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, g1_RH: torch.Tensor, g3_RH: torch.Tensor) -> tuple:
        x_RD, w1, w3, offs = ctx.saved_tensors
        need_x, need_w1, need_w3 = ctx.needs_input_grad[:3]
        grad_x, grad_w1 = _gmm_grads(g1_RH, x_RD, w1, offs, need_x, need_w1)
        grad_x3, grad_w3 = _gmm_grads(g3_RH, x_RD, w3, offs, need_x, need_w3)
        if need_x:  # in place unless a graph is being built
            grad_x = grad_x + grad_x3 if torch.is_grad_enabled() else grad_x.add_(grad_x3)
        return grad_x, grad_w1, grad_w3, None


def _project_up(rows_RD, src_SD, layout, w1_eHD, w3_eHD, offs_e, regather=True):
    """Step 1 of Note [The routed SwiGLU in two steps]: the rows of ``layout``
    (``permute_tokens(src_SD, layout)``), projected. ``regather``: backward gathers the rows
    again from ``src_SD`` instead of keeping them."""
    if torch.compiler.is_compiling():  # Note [grouped_mm under torch.compile]
        return _grouped_mm(rows_RD, w1_eHD, offs_e), _grouped_mm(rows_RD, w3_eHD, offs_e)
    if not regather:
        return _ProjectUp.apply(rows_RD, w1_eHD, w3_eHD, offs_e)
    regathered = _Regather(src_SD, layout)

    def pack(t: torch.Tensor) -> Any:
        return regathered if t is rows_RD else t

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        return _ProjectUp.apply(rows_RD, w1_eHD, w3_eHD, offs_e)


def _routed_swiglu(src_SD, layout, w1_eHD, w2_eDH, w3_eHD, offs_e, scores_R):
    """Both steps: what ``recompute_experts`` checkpoints whole."""
    rows_RD = permute_tokens(src_SD, layout)
    h1_RH, h3_RH = _project_up(rows_RD, src_SD, layout, w1_eHD, w3_eHD, offs_e, regather=False)
    return swiglu_down(h1_RH, h3_RH, w2_eDH, offs_e, scores_R)


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
    with autocast_off(x_RD):
        return _swiglu_on_path(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path)


def _swiglu_on_path(
    x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, path, scores_R=None, counts=None
) -> torch.Tensor:
    """:func:`grouped_swiglu` after its checks: resolve the path and run it. ``scores_R``: each
    row's combine weight, applied where :func:`swiglu_down` applies it (:func:`_weighted_down`).
    ``counts``: ``counts_e`` as host ints, when the caller has read them already."""
    counts = _host_counts(counts_e, path) if counts is None else counts
    chosen = resolve_compute_path(path, x_RD, w1_eHD, counts)
    if chosen != "grouped_mm" and counts is None:
        counts = counts_e.tolist()
        chosen = resolve_compute_path(chosen, x_RD, w1_eHD, counts)
    if counts is not None and sum(counts) != x_RD.shape[0]:
        raise ValueError(f"counts_e sums to {sum(counts)} but x_RD has {x_RD.shape[0]} rows")
    if chosen == "grouped_mm":
        if not isinstance(counts_e, torch.Tensor):
            counts_e = torch.tensor(counts, dtype=torch.int64)
        return _swiglu_grouped_mm(x_RD, w1_eHD, w2_eDH, w3_eHD, counts_e, scores_R)
    if chosen == "bmm":
        return _swiglu_bmm(x_RD, w1_eHD, w2_eDH, w3_eHD, counts[0], scores_R)
    return _swiglu_loop(x_RD, w1_eHD, w2_eDH, w3_eHD, counts, scores_R)


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
