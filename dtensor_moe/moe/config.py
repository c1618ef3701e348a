"""Configuration of the MoE layer.

Every field is documented in ``docs/moe.md``. The dataclass is frozen: a layer's configuration
is settled when the layer is built and never changes afterwards.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["AuxLossMode", "AuxLossType", "ComputePath", "DropPolicy", "MoEConfig", "ScoreFunc"]

ScoreFunc = Literal["softmax", "sigmoid"]
ComputePath = Literal["auto", "grouped_mm", "loop", "bmm"]
AuxLossMode = Literal["collect", "attach"]
AuxLossType = Literal["sequence", "global_batch"]
DropPolicy = Literal["probs", "position"]

_SCORE_FUNCS = ("softmax", "sigmoid")
_COMPUTE_PATHS = ("auto", "grouped_mm", "loop", "bmm")
_AUX_LOSS_MODES = ("collect", "attach")
_AUX_LOSS_TYPES = ("sequence", "global_batch")
_DROP_POLICIES = ("probs", "position")
# The float fields checked finite before any other check; ``capacity_factor``, the other one,
# is checked (finite and positive, or None) with the capacity fields.
_FLOAT_FIELDS = ("route_scale", "aux_loss_coeff", "z_loss_coeff", "init_std")
# The bool fields, checked to be ``True`` or ``False`` before any other check: any other value
# would be stored and read by its truthiness (``route_norm="no"`` would normalise).
_BOOL_FIELDS = (
    "route_norm",
    "score_before_experts",
    "use_expert_bias",
    "shared_expert_gate",
    "recompute_experts",
    "fused_routed_step",
    "pad_to_capacity",
    "force_balanced_routing",
)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Hyper-parameters of one :class:`~dtensor_moe.moe.MoE` layer.

    Keyword Args:
        dim: model (token) width ``D``.
        hidden_dim: hidden width ``H`` of each routed SwiGLU expert.
        num_experts: number of routed experts ``E``.
        top_k: experts each token is sent to ``K`` (``1 <= K <= E``).
        score_func: ``"softmax"`` or ``"sigmoid"`` over the router logits.
        route_norm: renormalise the ``K`` selected scores of a token to sum to 1.
        route_scale: constant factor applied to the selected scores (after ``route_norm``).
        router_dtype: the dtype of the router's logits: the gate's input and weight are cast to
            it (inside autograd, so the weight's gradient keeps the weight's dtype) and
            ``torch.autocast`` does not apply to the gate. ``None`` (default): the gate weight's
            dtype at the time of the forward (bf16 after ``model.to(torch.bfloat16)`` or under
            an FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``). ``torch.float32``
            routes in float32 whatever the parameters' dtype, as DeepSeek-V3 and
            Megatron-Core's ``moe_router_dtype`` do. A floating ``torch.dtype`` or its name
            (``"float32"``, ``"torch.float32"``); a name is stored as the dtype. The scores
            are computed from the logits in float32, or in ``router_dtype`` when it is wider.
        num_expert_groups: split the experts into this many equal groups for group-limited
            routing; ``None`` disables it.
        num_limited_groups: with ``num_expert_groups``, the number of groups each token may use.
        score_before_experts: multiply routed tokens by their score before the experts (``True``)
            or, inside the experts (``False``), each row's SwiGLU product before the down
            projection or its output after it, whichever is narrower (the same up to float
            rounding).
        use_expert_bias: keep an auxiliary-loss-free expert bias that changes expert selection
            only; update it with :func:`~dtensor_moe.moe.update_expert_bias`.
        aux_loss_coeff: coefficient of the auxiliary balance loss; ``0`` disables it.
        aux_loss_type: ``"sequence"`` (DeepSeek-V3's per-sequence balance loss, averaged over
            the sequences) or ``"global_batch"`` (one balance loss over the statistics of the
            whole global batch, reduced over the router's ``aux_loss_group``).
        z_loss_coeff: coefficient of the router z-loss, ``coeff * mean_t logsumexp(logits_t)^2``
            over the routed tokens; ``0`` disables it. It travels with the auxiliary loss
            (same collector, same ``aux_loss_mode``).
        aux_loss_mode: where the auxiliary loss goes when no
            :func:`~dtensor_moe.moe.balance.collect_aux_losses` block is open (inside one, it is
            always collected): ``"collect"`` raises ``ValueError`` in a training forward,
            ``"attach"`` attaches it to the output with gradient weight 1, which ignores loss
            scaling. See Note [Auxiliary loss follows the loss] in ``balance.py``.
        num_shared_experts: number of always-on shared SwiGLU experts (``0``: none).
        shared_hidden_dim: hidden width of each shared expert; ``None`` means ``hidden_dim``.
        shared_expert_gate: scale the shared experts' output per token by
            ``sigmoid(x @ g)``, with a learned ``g`` of shape ``(1, dim)`` (Qwen2-MoE's
            ``shared_expert_gate``); needs ``num_shared_experts > 0``.
        compute_path: ``"auto"``, ``"grouped_mm"``, ``"loop"`` or ``"bmm"``.
        pad_multiple: pad each expert's token group to a multiple of this (``1``: no padding).
        recompute_experts: keep only the routed experts' input for backward and recompute the
            expert math there (three more grouped matmuls per backward, the least activation
            memory); ``False`` keeps the two pre-activations. Results are identical either way.
            See Note [What the experts save for backward] in ``routed/kernels.py``.
        fused_routed_step: on the ``grouped_mm`` path (one process and under expert
            parallelism), run the routed SwiGLU in two steps whose backward keeps less: the
            gathered rows are gathered again and the SwiGLU products are not kept (Note [The
            routed SwiGLU in two steps] in ``routed/kernels.py``); ``False``: plain autograd. Outputs
            are the same bits either way, gradients the same up to float rounding.
        capacity_factor: each expert takes at most ``ceil(capacity_factor * T * K / E)``
            of the (token, expert) pairs of one forward's batch of ``T`` tokens and drops the
            rest; ``None`` (default): dropless. See Note [Expert capacity] in ``capacity.py``.
        capacity_per_expert: instead of ``capacity_factor``, a fixed capacity: each expert
            takes at most this many pairs of a forward's batch, whatever its size. With
            ``pad_to_capacity`` every shape of the expert-parallel exchange is then the same
            for every batch, so ranks may route batches of different sizes. ``None``
            (default): the capacity, if any, comes from ``capacity_factor``; set at most one.
        drop_policy: with a capacity, which pairs an over-subscribed expert keeps:
            ``"probs"`` (its highest combine weights) or ``"position"`` (its earliest tokens).
        pad_to_capacity: with a capacity, pad every expert's row group to exactly the
            capacity, so that every shape is static (no host read of counts; the sync-free
            expert-parallel exchange).
        init_std: standard deviation of the normal initialisation of all weights.
        force_balanced_routing: a debug mode for benchmarks that CHANGES THE MODEL'S OUTPUTS:
            the router ignores its scores for selection and sends the pairs of its ``T``
            tokens to the experts round-robin (token ``t``'s ``k``-th expert is
            ``(t * K + k) % E``), so every expert gets ``T * K / E`` pairs when ``E`` divides
            ``T * K`` (otherwise the counts differ by at most 1) and, under expert
            parallelism, every exchange is equal. The combine weights are still the gate's
            scores of those experts (normalised and scaled as usual), so the gate gets
            gradients and a step runs the same operations as a real one. For measuring
            best-case throughput and memory under perfect balance only; never for training a
            model. ``False`` (default): normal routing. See Note [Forced balanced routing] in
            ``router.py``.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    router_dtype: torch.dtype | str | None = None
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_before_experts: bool = False
    use_expert_bias: bool = False
    aux_loss_coeff: float = 0.0
    aux_loss_type: AuxLossType = "sequence"
    aux_loss_mode: AuxLossMode = "collect"
    z_loss_coeff: float = 0.0
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_expert_gate: bool = False
    compute_path: ComputePath = "auto"
    pad_multiple: int = 1
    recompute_experts: bool = False
    fused_routed_step: bool = True
    capacity_factor: float | None = None
    capacity_per_expert: int | None = None
    drop_policy: DropPolicy = "probs"
    pad_to_capacity: bool = False
    init_std: float = 0.02
    force_balanced_routing: bool = False

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_finite()
        self._check_router_dtype()
        self._check_sizes()
        self._check_routing()
        self._check_groups()
        self._check_capacity()

    @property
    def has_capacity(self) -> bool:
        """Whether experts have a capacity and drop pairs beyond it (``capacity_factor`` or
        ``capacity_per_expert`` set); ``False``: dropless."""
        return self.capacity_factor is not None or self.capacity_per_expert is not None

    @property
    def shared_hidden_total(self) -> int:
        """Hidden width of the fused shared-expert MLP (``num_shared_experts * shared hidden``)."""
        per_expert = self.hidden_dim if self.shared_hidden_dim is None else self.shared_hidden_dim
        return self.num_shared_experts * per_expert

    def _check_bools(self) -> None:
        """Every bool field is ``True`` or ``False`` (not ``1``, ``0``, ``"no"`` or ``None``)."""
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"MoEConfig.{name} must be a bool, got {value!r}; pass True or False"
                )

    def _check_finite(self) -> None:
        """Every float field is a finite real number (or ``None`` where allowed): a ``nan``
        coefficient would switch its loss off silently, an infinite one or an infinite
        ``route_scale``/``init_std`` would give non-finite losses or outputs."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars too
                raise TypeError(f"MoEConfig.{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(
                    f"MoEConfig.{name} must be a finite number, got {value!r}; nan and inf "
                    "are not accepted"
                )

    def _check_router_dtype(self) -> None:
        value = self.router_dtype
        if value is None:
            return
        dtype = value
        if isinstance(value, str):
            dtype = getattr(torch, value.removeprefix("torch."), None)
        if dtype not in FACTORY_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in FACTORY_DTYPES)
            raise ValueError(
                f"MoEConfig.router_dtype must be None or one of {names} (a torch.dtype or its "
                f"name), got {value!r}"
            )
        object.__setattr__(self, "router_dtype", dtype)  # a name is stored as the dtype

    def _check_sizes(self) -> None:
        for name in ("dim", "hidden_dim", "num_experts", "top_k", "pad_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "choose top_k <= num_experts"
            )
        if self.num_shared_experts < 0:
            raise ValueError(
                f"MoEConfig.num_shared_experts must be >= 0, got {self.num_shared_experts}"
            )
        if self.shared_hidden_dim is not None and self.shared_hidden_dim < 1:
            raise ValueError(
                f"MoEConfig.shared_hidden_dim must be positive or None, got "
                f"{self.shared_hidden_dim}"
            )
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError(
                "MoEConfig.shared_expert_gate=True needs shared experts; set "
                "num_shared_experts >= 1 or leave shared_expert_gate False"
            )
        if self.init_std <= 0:
            raise ValueError(f"MoEConfig.init_std must be positive, got {self.init_std}")

    def _check_routing(self) -> None:
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(
                f"MoEConfig.score_func={self.score_func!r} is not one of {_SCORE_FUNCS}"
            )
        if self.compute_path not in _COMPUTE_PATHS:
            raise ValueError(
                f"MoEConfig.compute_path={self.compute_path!r} is not one of {_COMPUTE_PATHS}"
            )
        if not self.route_scale > 0:
            raise ValueError(f"MoEConfig.route_scale must be positive, got {self.route_scale}")
        if self.aux_loss_coeff < 0:
            raise ValueError(
                f"MoEConfig.aux_loss_coeff must be >= 0 (0 disables it), got {self.aux_loss_coeff}"
            )
        if self.aux_loss_type not in _AUX_LOSS_TYPES:
            raise ValueError(
                f"MoEConfig.aux_loss_type={self.aux_loss_type!r} is not one of {_AUX_LOSS_TYPES}"
            )
        if not self.z_loss_coeff >= 0:
            raise ValueError(
                f"MoEConfig.z_loss_coeff must be >= 0 (0 disables it), got {self.z_loss_coeff}"
            )
        if self.aux_loss_mode not in _AUX_LOSS_MODES:
            raise ValueError(
                f"MoEConfig.aux_loss_mode={self.aux_loss_mode!r} is not one of {_AUX_LOSS_MODES}"
            )

    def _check_groups(self) -> None:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if groups is None and limited is None:
            return
        if groups is None or limited is None:
            raise ValueError(
                "group-limited routing needs both MoEConfig.num_expert_groups and "
                f"num_limited_groups, got num_expert_groups={groups}, "
                f"num_limited_groups={limited}; set both or neither"
            )
        if groups < 1 or self.num_experts % groups != 0:
            raise ValueError(
                f"MoEConfig.num_experts={self.num_experts} is not divisible by "
                f"num_expert_groups={groups}; choose a divisor of num_experts"
            )
        if not 1 <= limited <= groups:
            raise ValueError(
                f"MoEConfig.num_limited_groups={limited} must be in [1, num_expert_groups={groups}]"
            )
        reachable = limited * (self.num_experts // groups)
        if self.top_k > reachable:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds the {reachable} experts reachable in "
                f"num_limited_groups={limited} groups of {self.num_experts // groups}; raise "
                "num_limited_groups or lower top_k"
            )

    def _check_capacity(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise ValueError(
                f"MoEConfig.capacity_factor must be a positive finite number or None "
                f"(dropless), got {factor!r}"
            )
        if factor is not None and factor > self.num_experts:
            enough = self.num_experts / self.top_k
            raise ValueError(
                f"MoEConfig.capacity_factor={factor!r} exceeds num_experts={self.num_experts}, "
                "where the capacity ceil(capacity_factor * T * K / E) reaches all T * K pairs "
                "of the batch (a larger factor only pads more rows, and a huge one overflows "
                f"the capacity). num_experts / top_k = {enough:g} already gives every expert "
                f"room for every pair it can receive: use a factor <= {enough:g}, or None for "
                "dropless routing"
            )
        fixed = self.capacity_per_expert
        if fixed is not None and (
            isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1
        ):
            raise ValueError(
                f"MoEConfig.capacity_per_expert must be a positive int or None, got {fixed!r}"
            )
        if fixed is not None and factor is not None:
            raise ValueError(
                f"MoEConfig sets both capacity_factor={factor!r} and capacity_per_expert="
                f"{fixed!r}; set one: a capacity that scales with the batch (capacity_factor) "
                "or a fixed one (capacity_per_expert)"
            )
        if self.drop_policy not in _DROP_POLICIES:
            raise ValueError(
                f"MoEConfig.drop_policy={self.drop_policy!r} is not one of {_DROP_POLICIES}"
            )
        if self.pad_to_capacity and not self.has_capacity:
            raise ValueError(
                "MoEConfig.pad_to_capacity=True needs a capacity; set capacity_factor (for "
                "example 1.25) or capacity_per_expert, or leave pad_to_capacity False"
            )


def autocast_off(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context that turns ``torch.autocast`` off for ``t``'s device type where it is on, for
    the parts of the layer that compute in a dtype of their own (the router in
    ``router_dtype``, the routed experts in their weights' dtype: Note [Routed experts under
    autocast] in ``routed/kernels.py``); a no-op context otherwise."""
    device_type = t.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# Device types torch.autocast takes (torch.amp.is_autocast_available, as a constant that
# torch.compile reads without a graph break).
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu"})


# The dtypes the layer's modules are made in (their init draws normal values, which float8 and
# integer dtypes do not take): the dtypes torch.set_default_dtype accepts.
FACTORY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# What the layer's constructors take as ``device=``, as torch's factory functions do.
DeviceLike = torch.device | str | int | None


def factory_kwargs(device: DeviceLike, dtype: torch.dtype | None) -> dict[str, Any]:
    """``{"device": ..., "dtype": ...}`` for the layer's constructors, checked.

    Raises:
        ValueError: ``dtype`` is not a floating dtype the init can draw in (float8: build in
            float32, then ``.to(dtype)``), or ``device`` is not a device.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"the MoE layer's dtype must be a floating dtype, got dtype={dtype}")
    if dtype is not None and dtype not in FACTORY_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FACTORY_DTYPES)
        raise ValueError(
            f"the MoE layer is made in one of {names}; got dtype={dtype}. For float8 or "
            "another storage dtype, build in float32 and cast with .to(dtype) afterwards"
        )
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            msg = f"device={device!r} is not a device torch can use here: {err}"
            raise ValueError(msg) from None
    return {"device": device, "dtype": dtype}
