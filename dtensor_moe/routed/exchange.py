"""The exchange protocol: how routed rows reach the ranks that hold their experts, and return.

Shape legend:
    T  tokens routed by this rank
    D  model width
    E  routed experts (global count)
    K  experts per token

Note [Exchange protocol]
~~~~~~~~~~~~~~~~~~~~~~~~
An exchange backend is one class in one file, a subclass of :class:`TokenExchange` registered
under a name (:func:`register_exchange`); the parallel styles build it by that name
(``ExpertParallel(exchange="all_gather")``, ``parallelize_moe(..., exchange=...)``). Its four
stages run once per forward, in this order (``GroupedExperts.forward``)::

    routed = dispatch(x_TD, scores, ids, counts, capacity)  # check; sort; start any exchange
    received = receive(routed)                   # wait for the rows (None: nothing sent here)
    returning = send_back(out_of_received, routed)  # start the way back (None: nothing)
    y_TD = combine(out_of_local_rows, routed, returning)

The experts compute ``routed.layout``'s rows (this rank's own share) between ``dispatch`` and
``combine``, while the other rows travel. A backend keeps all per-forward state in the frozen
values the stages return (:class:`Routed`, :class:`Received`), never on ``self``.

What every backend must honour is declared on its class, and the base class checks each
declaration where it applies, so that none is dropped silently:

* ``hands_over_launches``: right after launching each collective, forward and backward, it
  calls :func:`announce_launch` (``overlap_f_b`` switches micro-batches there). A backend that
  declares ``False`` is refused by ``overlap_f_b`` by name.
* :meth:`TokenExchange.reads_host_sizes`: whether its stages read sizes on the host for this
  capacity, so that under ``torch.compile`` the layer runs them eagerly, as one island (Note
  [Eager islands under torch.compile] in ``moe/layer.py``); ``False`` means they trace.
* ``static_capacity``: with ``pad_to_capacity`` it keeps every size static (no host read, no
  count exchange); ``False``: such a capacity is refused by name before any collective.
* ``features``: what it supports beyond the plain exchange: ``"expert_tp"`` (rows sent to every
  hidden slice of their expert: ``replicas > 1``), ``"pad_multiple"``, ``"score_before_experts"``
  and ``"own_rows"`` (``overlap``: the rank's own rows computed while the others travel). A
  backend built with one it lacks raises, naming the backend, the feature and what to use.

The output of ``combine`` is the tokens' sum over their experts. When the experts' outputs are
partial sums over a mesh (``ExpertTensorParallel(dispatch="gather")``: the tokens were gathered,
not exchanged), the base class returns it as a ``Partial`` DTensor on that mesh, for every
backend alike.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from dtensor_moe import _compat
from dtensor_moe.routed.layouts import Capacity, ExpertLayout

__all__ = [
    "FEATURES",
    "Received",
    "Routed",
    "TokenExchange",
    "announce_launch",
    "exchange_class",
    "exchange_names",
    "local_rank",
    "mesh_ranks",
    "register_exchange",
    "set_after_launch",
]

FEATURES = frozenset({"expert_tp", "pad_multiple", "score_before_experts", "own_rows"})

# Called with no argument right after every exchange is launched, forward or backward (a
# scheduler that interleaves two micro-batches switches to the other one there); ``None``: no
# call. Set it through ``set_after_launch``.
_after_launch: Any = None


def set_after_launch(hook: Any) -> Any:
    """Install ``hook`` (a callable taking no argument, or ``None``) to run right after every
    exchange's collective is launched; returns the previous one."""
    global _after_launch
    previous, _after_launch = _after_launch, hook
    return previous


def announce_launch() -> None:
    """What a backend calls right after launching a collective, forward and backward (Note
    [Exchange protocol]: ``hands_over_launches``)."""
    if _after_launch is not None:
        _after_launch()


# Note [Ranks of a mesh, read once]
# A mesh's ranks and this process's position in it never change, but reading them costs a
# tensor-to-list conversion (``mesh.mesh.tolist()``) or a process-group lookup
# (``get_local_rank``), and under ``torch.compile`` both are host reads of tensor data that
# break the graph. So the objects that need them (exchanges, the token-parallel forward)
# read them once, at construction, through the two helpers below, and keep them as plain
# ints and tuples: this is the one place the local rank comes from.


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh`` in its row-major order, as a tuple of ints."""
    return tuple(mesh.mesh.flatten().tolist())


def local_rank(mesh: DeviceMesh) -> int:
    """This process's index in the 1-D ``mesh``; ``ValueError`` if it is not a member."""
    if mesh.ndim != 1:
        raise ValueError(f"local_rank needs a 1-D DeviceMesh, got {mesh} ({mesh.ndim}-D)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"this process (rank {dist.get_rank()}) is not a member of {mesh}; build the "
            "layer's meshes on every rank that runs it"
        )
    return coordinate[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Routed:
    """What :meth:`TokenExchange.dispatch` returns: the rows this rank computes itself, and
    what :meth:`~TokenExchange.receive` and :meth:`~TokenExchange.combine` need.

    Attributes:
        source: ``x_TD``: the local rows are gathered from it.
        scores: each pair's combine weight ``(T, X)`` in ``source``'s dtype (``X = K``, or
            ``K * replicas`` under expert TP by all-to-all).
        layout: the rows this rank computes itself (all of them without an exchange).
        row_TK: each pair's row among the rows combine sums.
        order_N: the inverse of ``row_TK`` when it is a permutation, else ``None``.
        void_row: ``row_TK`` may name one row past the end (Note [The void row]).
        exchange: the backend's state of this forward's exchange (``None`` without one).
    """

    source: torch.Tensor
    scores: torch.Tensor
    layout: ExpertLayout
    row_TK: torch.Tensor
    order_N: torch.Tensor | None
    void_row: bool = False
    exchange: Any = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Received:
    """The rows other ranks sent here (:meth:`TokenExchange.receive`): ``rows``, their
    ``scores`` (``None``: the rows travelled scaled, ``score_before_experts``) and the
    ``layout`` that groups them by local expert."""

    rows: torch.Tensor
    scores: torch.Tensor | None
    layout: ExpertLayout


_EXCHANGES: dict[str, type[TokenExchange]] = {}
_DECLARED = ("name", "hands_over_launches", "static_capacity", "features")


def register_exchange(cls: type[TokenExchange]) -> type[TokenExchange]:
    """Class decorator: make the backend ``cls`` buildable by its ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, TokenExchange)):
        raise TypeError(f"register_exchange takes a TokenExchange subclass, got {cls!r}")
    known = _EXCHANGES.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(
            f"an exchange named {cls.name!r} is already registered ({known.__qualname__}); "
            "give the new backend another name"
        )
    _EXCHANGES[cls.name] = cls
    return cls


def exchange_names() -> tuple[str, ...]:
    """The names of the registered backends."""
    return tuple(sorted(_EXCHANGES))


def exchange_class(exchange: str | type[TokenExchange]) -> type[TokenExchange]:
    """The backend class for a registered name, or the class itself."""
    if isinstance(exchange, type) and issubclass(exchange, TokenExchange):
        return exchange
    if isinstance(exchange, str) and exchange in _EXCHANGES:
        return _EXCHANGES[exchange]
    raise ValueError(
        f"unknown exchange {exchange!r}; the registered backends are {list(exchange_names())} "
        "(or pass a TokenExchange subclass)"
    )


class TokenExchange(abc.ABC):
    """Base of the exchange backends; see Note [Exchange protocol].

    Keyword Args:
        num_experts: ``E``, routed experts in the whole layer.
        pad_multiple: align each local expert's row group to this multiple (``1``: none).
        score_before_experts: scale routed rows by their score before the experts instead of
            their outputs after.
        mesh: 1-D mesh of the ranks that exchange rows (``None``: no exchange).
        replicas: ranks of ``mesh`` that each hold a hidden slice of the same experts (expert
            TP by exchange); ``1`` without.
        partial_mesh: 1-D mesh over which the experts' outputs are partial sums (expert TP
            on gathered tokens); :meth:`combine` then returns a ``Partial`` DTensor on it.
        overlap: compute this rank's own rows while the others travel, where the backend can.

    A subclass declares ``name``, ``hands_over_launches``, ``static_capacity`` and
    ``features`` as class attributes and implements :meth:`sort_and_send`, :meth:`_combine` and
    :meth:`reads_host_sizes`; :meth:`receive` and :meth:`send_back` return ``None`` unless it
    sends rows away.
    """

    name: ClassVar[str]
    hands_over_launches: ClassVar[bool]
    static_capacity: ClassVar[bool]
    features: ClassVar[frozenset[str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "__abstractmethods__", None):
            return
        missing = [a for a in _DECLARED if not hasattr(cls, a)]
        if missing:
            raise TypeError(
                f"exchange backend {cls.__qualname__} must declare {missing} as class "
                "attributes (Note [Exchange protocol] in dtensor_moe/routed/exchange.py)"
            )
        unknown = set(cls.features) - FEATURES
        if unknown:
            raise TypeError(
                f"exchange backend {cls.__qualname__} declares unknown features "
                f"{sorted(unknown)}; the known ones are {sorted(FEATURES)}"
            )

    def __init__(
        self,
        *,
        num_experts: int,
        pad_multiple: int = 1,
        score_before_experts: bool = False,
        mesh: DeviceMesh | None = None,
        replicas: int = 1,
        partial_mesh: DeviceMesh | None = None,
        overlap: bool = True,
    ) -> None:
        if num_experts < 1 or pad_multiple < 1:
            raise ValueError(
                f"{type(self).__name__} needs num_experts >= 1 and pad_multiple >= 1, got "
                f"num_experts={num_experts}, pad_multiple={pad_multiple}"
            )
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        for label, m in (("mesh", mesh), ("partial_mesh", partial_mesh)):
            if m is not None and m.ndim != 1:
                raise ValueError(f"{label} must be a 1-D DeviceMesh, got a {m.ndim}-D mesh")
        size = 1 if mesh is None else mesh.size()
        if replicas < 1 or size % replicas != 0 or num_experts % (size // replicas) != 0:
            raise ValueError(
                f"{type(self).__name__}: the mesh of {size} ranks must hold whole groups of "
                f"replicas={replicas} ranks, and num_experts={num_experts} must be divisible by "
                f"the expert-parallel degree {size // max(replicas, 1)}"
            )
        wanted = {"expert_tp": replicas > 1, "pad_multiple": pad_multiple > 1,
                  "score_before_experts": score_before_experts}  # fmt: skip
        for feature, used in wanted.items():
            if used and feature not in self.features:
                raise ValueError(
                    f"the {self.name!r} exchange does not support {feature} (got "
                    f"replicas={replicas}, pad_multiple={pad_multiple}, score_before_experts="
                    f"{score_before_experts}); use exchange='all_to_all', which supports "
                    "every feature, or leave the setting at its default"
                )
        self.num_experts = num_experts
        self.pad_multiple = pad_multiple
        self.score_before_experts = score_before_experts
        self.mesh = mesh
        self.replicas = replicas
        self.partial_mesh = partial_mesh
        self.overlap = overlap and "own_rows" in self.features
        # Note [Ranks of a mesh, read once]
        self.ranks: tuple[int, ...] = () if mesh is None else mesh_ranks(mesh)
        self.partial_ranks: tuple[int, ...] = (
            () if partial_mesh is None else mesh_ranks(partial_mesh)
        )
        self.rank: int = 0 if mesh is None else local_rank(mesh)
        # Note [Ranks with identical tokens]: set once the first forward's check has passed.
        self.tokens_checked = False

    @property
    def ep_size(self) -> int:
        """Ranks that hold different experts: the mesh size over ``replicas``."""
        return 1 if self.mesh is None else self.mesh.size() // self.replicas

    @property
    def experts_per_rank(self) -> int:
        """``e``: the experts each rank holds."""
        return self.num_experts // self.ep_size

    # -- the stages --------------------------------------------------------------------------

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> Routed:
        """:meth:`check_routing`, then :meth:`sort_and_send`.

        ``capacity``: some pairs may be dropped (id ``E``; Note [Expert capacity] in
        ``dtensor_moe/moe/capacity.py``), and ``counts_E`` counts the kept ones.
        """
        self.check_routing(x_TD, topk_scores_TK, topk_ids_TK, counts_E, capacity)
        scores_TK = topk_scores_TK.to(x_TD.dtype)
        return self.sort_and_send(x_TD, scores_TK, topk_ids_TK, counts_E, capacity)

    def check_routing(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None = None,
    ) -> None:
        """Every backend's checks, before any collective: the shapes, the capacity mode, and
        (with a mesh) that the ranks route different tokens."""
        self._check_inputs(x_TD, topk_scores_TK, topk_ids_TK, counts_E)
        if capacity is not None and capacity.padded and not self.static_capacity:
            raise ValueError(
                f"the {self.name!r} exchange does not support pad_to_capacity (the static "
                "exchange at capacity); set MoEConfig.pad_to_capacity=False or use "
                "exchange='all_to_all'"
            )
        if self.mesh is not None:
            self._check_distinct_tokens(x_TD, capacity)

    def receive(self, routed: Routed) -> Received | None:
        """The rows other ranks sent, once they are here; ``None``: none were sent."""
        return None

    def send_back(self, out_RD: torch.Tensor, routed: Routed) -> Any:
        """Start returning the expert outputs of :meth:`receive`'s rows; ``None``: none."""
        return None

    def combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any = None) -> torch.Tensor:
        """Each token's expert outputs (already weighted by the scores), summed: ``y_TD``; a
        ``Partial`` DTensor on ``partial_mesh`` when there is one."""
        y_TD = self._combine(local_RD, routed, returning)
        if self.partial_mesh is None:
            return y_TD
        return DTensor.from_local(y_TD, self.partial_mesh, [Partial()], run_check=False)

    @abc.abstractmethod
    def sort_and_send(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
        capacity: Capacity | None,
    ) -> Routed:
        """Sort the pairs and start any exchange, after :meth:`check_routing`; ``scores_TK``
        in ``x_TD``'s dtype."""

    @abc.abstractmethod
    def _combine(self, local_RD: torch.Tensor, routed: Routed, returning: Any) -> torch.Tensor:
        """:meth:`combine` before the ``Partial`` wrap."""

    @abc.abstractmethod
    def reads_host_sizes(self, capacity: Capacity | None = None) -> bool:
        """Whether the stages read sizes on the host (or run ops that do not trace) for this
        capacity: then ``torch.compile`` runs the routed experts eagerly (Note [Eager islands
        under torch.compile] in ``moe/layer.py``)."""

    # -- checks shared by every backend ---------------------------------------------------------

    def _check_inputs(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> None:
        if x_TD.dim() != 2 or topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(
                f"dispatch expects x_TD (T, D) and topk_ids_TK (T, K) with the same T, got "
                f"{tuple(x_TD.shape)} and {tuple(topk_ids_TK.shape)}"
            )
        if topk_scores_TK.shape != topk_ids_TK.shape:
            raise ValueError(
                f"topk_scores_TK {tuple(topk_scores_TK.shape)} and topk_ids_TK "
                f"{tuple(topk_ids_TK.shape)} must have the same shape"
            )
        if counts_E.shape != (self.num_experts,):
            raise ValueError(
                f"counts_E has shape {tuple(counts_E.shape)}, expected ({self.num_experts},) "
                "(one count per routed expert)"
            )

    def _check_distinct_tokens(self, x_TD: torch.Tensor, capacity: Capacity | None) -> None:
        """Note [Ranks with identical tokens]: raise on every rank if two ranks of the mesh
        route the same tokens (or, with ``pad_to_capacity``, have different capacities: Note
        [Static exchange at capacity] in ``all_to_all.py``). Runs on the first forward with
        gradients enabled, and on every one under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: one
        all-gather of three numbers.

        Under ``torch.compile`` the check runs eagerly: a graph break on the first forward
        only; the flag it sets then recompiles it away. Compiled code does not read the debug
        level (no check per forward under DETAIL)."""
        compiling = torch.compiler.is_compiling()
        detail = not compiling and dist.get_debug_level() == dist.DebugLevel.DETAIL
        if (self.tokens_checked and not detail) or not torch.is_grad_enabled():
            return
        if not compiling and _compat.in_pipeline_metadata_inference():
            return  # torch's shape pass: no training data (uninitialised buffers after stage 0)
        self._token_check(x_TD, capacity)

    def _token_check(self, x_TD: torch.Tensor, capacity: Capacity | None) -> None:
        """The check of :meth:`_check_distinct_tokens`, once it is due."""
        x = x_TD.detach().reshape(-1).to(torch.float64)
        # A position-weighted sum: equal for identical tokens, distinct otherwise but by a
        # coincidence of measure zero. Ranks without tokens, or with all-zero tokens, prove
        # nothing and are left out.
        weights = torch.cos(torch.arange(x.numel(), device=x.device, dtype=torch.float64))
        static_c = capacity.per_expert if capacity is not None and capacity.padded else -1
        mine = torch.tensor([float(x_TD.shape[0]), 0.0, float(static_c)], dtype=torch.float64,
                            device=x.device)
        mine[1] = (x * weights).sum()
        gathered = funcol.all_gather_single(mine, 0, self.mesh).view(-1, 3).tolist()
        _check_equal_capacity([int(c) for _, _, c in gathered], self.mesh, self.ranks)
        seen: dict[tuple[float, float], int] = {}
        for position, (tokens, checksum, _) in enumerate(gathered):
            if tokens == 0 or checksum == 0:
                continue
            first = seen.setdefault((tokens, checksum), position)
            if first != position:
                raise ValueError(
                    f"expert parallelism over {self.mesh}: ranks {self.ranks[first]} and "
                    f"{self.ranks[position]} route identical tokens ({int(tokens)} rows), so "
                    "their expert gradients would be summed as if they were different data "
                    "(too large by the number of such ranks). If they are the tp ranks of a "
                    "tensor-parallel block, apply PrepareMoEInput(routing='split') to the MoE "
                    "(parallelize_moe does), so that each routes its own share of the "
                    "tokens; otherwise give the ranks different data"
                )
        self.tokens_checked = True

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"replicas={self.replicas}, partial={self.partial_mesh is not None}, "
            f"pad_multiple={self.pad_multiple}, score_before_experts={self.score_before_experts}, "
            f"overlap={self.overlap})"
        )


# Note [Ranks with identical tokens]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Expert parallelism assumes that the ranks of its mesh route different tokens: each expert
# sums the gradients of the rows it receives, and the result is labelled the complete
# gradient. Ranks that route the same tokens (for example the tp ranks of a block, with the
# plan applied without PrepareMoEInput) still give correct outputs, but expert gradients too
# large by the number of such ranks, silently. So an exchange with a mesh all-gathers a
# checksum of each rank's tokens (token count and a position-weighted float64 sum) once, on its
# first forward with gradients enabled, and on every forward under TORCH_DISTRIBUTED_DEBUG=
# DETAIL; every rank sees the same gathered values and so raises the same ValueError, before
# any exchange. Forwards without gradients (evaluation, which may well give every rank the same
# batch) are not checked, nor the forward of torch's pipeline metadata inference (a
# ``PipelineStage`` built without static metadata; the stages after the first run it on
# uninitialised buffers, which may be equal on every rank): every rank of the mesh is in that
# pass alike, and the check waits for the first real training forward. The verdict lives on
# the exchange (``tokens_checked``).


def _check_equal_capacity(capacities: list[int], mesh: DeviceMesh, ranks: tuple[int, ...]) -> None:
    """Note [Static exchange at capacity]: the ranks of ``mesh`` must agree on the capacity
    (``-1``: not padded to capacity); ``capacities`` is the all-gathered list, the same on every
    rank, so every rank raises alike."""
    if len(set(capacities)) <= 1:
        return
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, capacities, strict=True))
    raise ValueError(
        f"pad_to_capacity under expert parallelism over {mesh} needs the same expert capacity "
        f"on every rank, got {per_rank} (-1: no pad_to_capacity). A capacity_factor's capacity "
        "follows the number of tokens a forward routes, so give every rank the same batch "
        "shape (B, L), or set a fixed capacity_per_expert instead (the same on every rank "
        "for any batch), or set pad_to_capacity=False (the exchange then reads its sizes on "
        "the host)"
    )
