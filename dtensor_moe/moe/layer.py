"""The MoE layer: router, routed experts (``dtensor_moe.routed``), shared experts.

Shape legend:
    B  sequences, L  tokens per sequence, T = B * L
    D  model width
    K  experts per token

Data flow (one rank)::

    x (B, L, D) -> x_TD -> shared_experts(x_TD)
                       -> router -> topk_scores_TK, topk_ids_TK, counts_E (, aux_loss)
      -> experts: dispatch -> grouped SwiGLU -> combine -> y_TD
      -> (+ the shared output) -> route the aux loss (collect or attach) -> y (B, L, D)
"""

# ruff: noqa: N806

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.moe.balance import attach_aux_loss
from dtensor_moe.moe.config import DeviceLike, MoEConfig, factory_kwargs
from dtensor_moe.moe.protocol import Router, check_router
from dtensor_moe.moe.router import TokenChoiceTopKRouter, count_unless_recompute
from dtensor_moe.moe.shared import SharedExperts
from dtensor_moe.moe.tokens import RoutedTokens
from dtensor_moe.routed import GroupedExperts, LocalExchange

__all__ = ["MoE"]

# Note [Meta-device init]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Large models are built on the ``meta`` device (``with torch.device("meta"): model = ...``),
# parallelized and sharded there (``parallelize_moe``, ``fully_shard_moe``), then materialised
# with ``model.to_empty(device=...)``, whose memory holds garbage. ``MoE.reset_parameters`` then
# initialises everything construction does, the router's buffers included (a garbage
# ``expert_bias`` would steer the routing; garbage counters would mislead ``load_stats`` and
# ``update_expert_bias``). A generic loop that calls ``reset_parameters`` on every module also
# reaches ``router.gate`` and the shared experts' ``nn.Linear`` children, whose own reset is
# torch's Kaiming init, after the MoE's: call ``MoE.reset_parameters`` last, or instead. Loading a
# checkpoint instead sets the parameters and the expert bias (persistent) but not the counters
# (not persistent): call ``router.reset_counters()``. ``dtensor_moe.hf.moe_from_hf`` builds on the
# block's device, so a ``meta`` HF model converts without allocating. Sharded parameters: torch's
# DTensor random ops give each shard its own part of one random stream only on CUDA-like devices
# (``torch.distributed.tensor._random.is_rng_supported_mesh``). On CPU meshes every rank draws its
# shard from its own generator, so when the ranks share a seed every shard repeats the others (the
# experts of different EP ranks, FSDP's shards too); torch warns "DTensor random operators may not
# have complete support on cpu device mesh". There, load a checkpoint after ``to_empty``. The
# multi-GPU case is not covered by the tests, which run on CPU meshes. Tests:
# ``tests/test_moe_layer.py``, ``tests/test_hf.py`` and
# ``tests/test_fsdp_moe.py::test_meta_device_init`` (which also shows the CPU repetition, so
# that this paragraph changes when torch does).


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer; ``y = moe(x)`` keeps shape, dtype and device.

    Children:
        ``router`` (:class:`TokenChoiceTopKRouter`, or the ``router`` given), ``experts``
        (:class:`~dtensor_moe.routed.GroupedExperts`, run by its ``experts.plan``),
        ``shared_experts`` (:class:`SharedExperts` or ``None``).

    Args:
        config: the layer's :class:`MoEConfig`.
        router: the router to use, any ``nn.Module`` with the members of
            :class:`~dtensor_moe.moe.protocol.Router` (Note [Router protocol] in
            ``protocol.py``), used as given (``device`` and ``dtype`` do not apply to it);
            ``None``: a :class:`TokenChoiceTopKRouter` of ``config``, whose router fields
            (``top_k``, ``score_func``, the losses and the bias, ...) apply to it only.
        device, dtype: where and in which floating dtype the parameters and buffers are made,
            as torch's own modules take them (``None``: torch's current default device and
            dtype). No global default changes. The router's ``expert_bias`` is float32 whatever
            ``dtype`` is, and stays so under later casts (Note [Expert bias keeps its dtype]
            in ``router.py``); its counters are int64. ``device="meta"`` allocates nothing (Note
            [Meta-device init]). The values drawn come from the device's random stream, so a
            layer made on a GPU does not hold the same numbers as one made on the CPU under the
            same seed and moved (``.to``) afterwards.

    Example::

        moe = MoE(MoEConfig(dim=256, hidden_dim=512, num_experts=8, top_k=2))
        y = moe(torch.randn(4, 128, 256))
        big = MoE(moe.config, device="cuda", dtype=torch.bfloat16)  # made there, no copy

    No collective runs in forward or backward of the single-process layer; parallel styles add
    them through the exchange backend and the DTensor weights.

    Note [MoE under torch.compile]: in one process, ``torch.compile(moe)`` (or of a block that
    holds it) traces the whole layer in float32 and bf16 with the default ``compute_path``:

    * tokens per expert are counted with a static-shape ``scatter_add`` (``expert_counts``),
      not ``bincount``, and the expert path reads no counts on the host while compiling;
    * the grouped matmuls go through ``dtensor_moe::grouped_mm`` (Note [grouped_mm under
      torch.compile] in ``routed/kernels.py``), which traces in float32 too;
    * in training, the router's ``tokens_per_expert`` update runs eagerly, last in the forward,
      so that an activation-checkpoint recompute does not count twice: the one graph break
      (none in eval mode). ``fullgraph=True`` therefore works in eval mode and raises, in
      training, a message saying to use ``fullgraph=False``;
    * the ``loop``/``bmm`` paths (forced, or ``auto`` with a dtype or row alignment that
      ``torch._grouped_mm`` does not take) need host counts, as do ``pad_multiple > 1``, a
      capacity without ``pad_to_capacity`` and expert parallelism: the routed experts then run
      eagerly, called from this frame, which is then the one break in training too: the counter
      update runs in that island (Note [Eager islands under torch.compile]).

    ``tests/test_moe_compile.py`` pins the break counts and checks outputs, input and param
    gradients and the router buffers against eager, also under activation checkpointing.

    Note [One forward] (``tokens.py``): this forward is the layer's only one. A parallel style
    that changes how tokens reach the layer (tensor or sequence parallelism,
    :class:`~dtensor_moe.parallel.PrepareMoEInput`) wraps it with an input and an output hook,
    as torch's styles do, and passes ``tokens`` (a
    :class:`~dtensor_moe.parallel.token_parallel.TokenSplit`); the children are always called
    as modules. The shared experts run before the router: under a parallel layout their input,
    a DTensor, must not stay alive past the routed experts, which ``torch.compile`` runs
    eagerly (Note [Expert parallelism under torch.compile]).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        router: Router | None = None,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE expects a MoEConfig, got {type(config).__name__}")
        factory = factory_kwargs(device, dtype)
        self.config = config
        if router is None:
            router = TokenChoiceTopKRouter(config, **factory)
        self.router = check_router(router, num_experts=config.num_experts)
        exchange = LocalExchange(
            num_experts=config.num_experts,
            pad_multiple=config.pad_multiple,
            score_before_experts=config.score_before_experts,
        )
        self.experts = GroupedExperts(
            dim=config.dim,
            hidden_dim=config.hidden_dim,
            num_experts=config.num_experts,
            compute_path=config.compute_path,
            exchange=exchange,
            init_std=config.init_std,
            recompute_experts=config.recompute_experts,
            fused_routed_step=config.fused_routed_step,
            **factory,
        )
        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = SharedExperts(
                dim=config.dim,
                hidden_dim=config.shared_hidden_total,
                init_std=config.init_std,
                gated=config.shared_expert_gate,
                **factory,
            )
        # Configuration set once by PrepareMoEInput (a TokenParallel), ``None`` otherwise.
        self.token_parallel: object | None = None

    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer as construction does: the router's gate
        (normal, ``init_std``), expert bias (zero) and counters (zero), the routed and the shared
        experts (normal, ``init_std``). The values differ from a fresh construction's under the
        same seed (construction also runs ``nn.Linear``'s own init first).

        For a layer built on the ``meta`` device (Note [Meta-device init]): after
        ``model.to_empty(device=...)``, call it on every :class:`MoE`, or load a checkpoint and
        then ``router.reset_counters()``.
        """
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()

    def forward(self, x: torch.Tensor, *, tokens: RoutedTokens | None = None) -> torch.Tensor:
        """``x`` ``(B, L, D)``; ``tokens`` is for parallel styles (Note [One forward])."""
        if tokens is None:
            self._check_input(x)
            tokens = RoutedTokens.whole_batch(x.shape)
            x = x.reshape(-1, x.shape[-1])
        D = x.shape[-1]
        shared_TD = None
        if self.shared_experts is not None:
            shared_TD = tokens.local(self.shared_experts(x)).reshape(-1, D)
        routing = self.router(x, tokens=tokens, count=False)
        x_TD = tokens.local(x).reshape(-1, D)
        del x  # only plain tensors cross the experts (see above)
        capacity = {} if routing.capacity is None else {"capacity": routing.capacity}
        args = (x_TD, routing.topk_scores_TK, routing.topk_ids_TK, routing.counts_E)
        # the router's counter update: last in the forward, or in the island (both eager)
        count = None
        if self.router.training:
            count = (self.router, routing.count_E, routing.dropped_E)
        if torch.compiler.is_compiling() and _eager_under_compile(
            self.experts, x_TD, routing.capacity
        ):
            y_TD = _experts_eagerly(self.experts, count, *args, **capacity)
            count = None  # counted in the island: no second break at the end
        else:
            y_TD = self.experts(*args, **capacity)
        if isinstance(y_TD, DTensor):  # expert TP with gathered tokens: Partial on the etp mesh
            y_TD = y_TD.to_local()
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        if routing.aux_loss is not None:
            y_TD = attach_aux_loss(
                y_TD,
                routing.aux_loss,
                mode=self.config.aux_loss_mode,
                scale=self.router.aux_loss_scale,
            )
        y = tokens.output(y_TD)
        if count is not None:  # last, and from this frame: Note [MoE under torch.compile]
            count_unless_recompute(*count)
        return y

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.config.dim:
            raise ValueError(
                f"MoE expects x of shape (batch, seq_len, dim={self.config.dim}), got "
                f"{tuple(x.shape)}; reshape the input or fix MoEConfig.dim"
            )
        if not x.is_floating_point():
            raise ValueError(f"MoE expects a floating-point input, got dtype={x.dtype}")


# Note [Eager islands under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some expert calls read counts or exchange sizes on the host: the expert-parallel exchange
# (Note [Expert parallelism under torch.compile] in ``routed/all_to_all.py``), ``pad_multiple >
# 1``, a capacity without ``pad_to_capacity``, and the ``loop``/``bmm`` compute paths. Traced,
# each such read would break the graph and recompile for every new count, so that code runs
# eagerly. A caller of ``GroupedExperts`` alone gets a graph break at each such read; but a
# break deep inside
# the experts is counted once per Python frame around it (the experts' forward, the exchange's
# stages, ...), each frame resumes in a compiled piece of its own, and every piece
# costs a guard check and a runtime wrapper per call. So while compiling, ``MoE.forward`` asks
# the experts first (``GroupedExperts.runs_eagerly_under_compile``, which asks its
# plan) and, when they would run
# eagerly in part, calls the whole experts module eagerly from its own frame: one graph break
# in the layer, with torch's default ``nested_graph_breaks=False`` too. The island runs
# exactly the eager code (the module's hooks included), so results are the eager ones; the
# router, the shared experts and the token-parallel views around it stay compiled. In training,
# the router's counter update (eager too, Note [MoE under torch.compile]) runs in the island
# rather than at the end of the forward, so the island is the layer's only break. An experts
# module without that method (a user's own) is called as usual. The question is asked about the
# input the layer hands the experts, before their module's own hooks: a hook that changes the
# dtype (an FSDP2 unit's cast) and so the compute path leaves the experts' own islands to act,
# one frame further down: the same results, more breaks.


def _eager_under_compile(experts: nn.Module, x_TD: torch.Tensor, capacity) -> bool:
    ask = getattr(experts, "runs_eagerly_under_compile", None)
    return ask is not None and bool(ask(x_TD, capacity))


def _experts_eagerly(experts: nn.Module, count: tuple | None, *args, **kwargs) -> torch.Tensor:
    y_TD = experts(*args, **kwargs)
    if count is not None:  # the router's counter update, here rather than in a break of its own
        count_unless_recompute(*count)  # after the experts, as in eager: a failed call counts none
    # A DTensor leaving the island would reach AOT autograd as an output whose tangent it
    # cannot match; the layer takes the local tensor of the Partial output anyway.
    return y_TD.to_local() if isinstance(y_TD, DTensor) else y_TD


_experts_eagerly = torch.compiler.disable(
    _experts_eagerly,
    reason="dtensor_moe runs the routed experts eagerly under torch.compile when they read "
    "counts or exchange sizes on the host: expert parallelism, pad_multiple > 1, a capacity "
    "without pad_to_capacity, or the loop/bmm compute paths (Note [Eager islands under "
    "torch.compile] in dtensor_moe/moe/layer.py); compile with fullgraph=False",
)
