"""Tensor (and sequence) parallelism of the dense layers of a pre-norm MoE transformer.

:func:`parallelize_dense` applies torch's own styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``) to the embedding, the attention projections, the
norms and the output head; :func:`dense_tp_plan` returns the same plan as a dict, for a model
that needs a few more entries. The MoE layers are left to
:func:`~dtensor_moe.parallel.parallelize_moe`. :class:`DenseNames` says where the layers are;
its defaults are the names of the demo model (``dtensor_moe/demo/model.py``).

Note [Dense plan and the residual stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every block is ``x + f(norm(x))``, so the two operands of each residual add must have the same
kind: both plain tensors or both DTensors.

- Without sequence parallelism the residual stream is a plain tensor, the same on every tp
  rank: the embedding and each row-wise projection all-reduce to ``Replicate()`` and hand back
  the local tensor (``use_local_output=True``), and the MoE layer given a plain tensor returns
  a plain tensor.
- With sequence parallelism the residual stream is a ``Shard(1)`` DTensor: the embedding and
  each row-wise projection reduce-scatter to ``Shard(1)`` and must keep the DTensor
  (``use_local_output=False``), because the MoE layer given a ``Shard(1)`` DTensor returns one,
  and ``plain + DTensor`` fails in DTensor's dispatch ("got mixed torch.Tensor and DTensor").
  The norms run on the sequence shards with replicated weights (``SequenceParallel``); the
  attention module's input is all-gathered once to ``Replicate()`` (``PrepareModuleInput``)
  before its column-wise projections, and the output head all-gathers its input.

The column-wise projections return local tensors holding ``heads / tp`` heads, so the attention
code must reshape with ``view(B, L, -1, head_dim)`` rather than the global head count.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["DenseNames", "dense_tp_plan", "parallelize_dense"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseNames:
    """Where the dense layers of a pre-norm transformer are, as module names (FQNs).

    The defaults are the names of :class:`~dtensor_moe.demo.model.MoETransformer`. Names in the
    per-block fields are relative to each block of ``layers``. ``None`` (or an empty tuple)
    leaves that part alone.

    Keyword Args:
        embedding: the token ``nn.Embedding`` (vocabulary rows sharded over tp).
        layers: the container of blocks (an ``nn.ModuleList`` or any module whose children are
            the blocks).
        gathered: per block, the modules whose first input is all-gathered from ``Shard(1)``
            to ``Replicate()`` under sequence parallelism (the attention module, parent of its
            column-wise projections). Empty: each column-wise projection gathers its own input.
        colwise: per block, the ``nn.Linear`` layers that read the block's normed input
            (attention ``q``/``k``/``v``): output features sharded over tp.
        rowwise: per block, the ``nn.Linear`` layers that write to the residual stream
            (attention output): input features sharded over tp, output reduced.
        norms: per block, the norms (``SequenceParallel`` under sequence parallelism; left
            alone without it).
        final_norm: the norm before the output head.
        output: the output head ``nn.Linear`` (vocabulary columns sharded; logits all-gathered
            to a plain, full tensor).
    """

    embedding: str | None = "tok_embeddings"
    layers: str = "layers"
    gathered: tuple[str, ...] = ("attention",)
    colwise: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv")
    rowwise: tuple[str, ...] = ("attention.wo",)
    norms: tuple[str, ...] = ("attention_norm", "moe_norm")
    final_norm: str | None = "norm"
    output: str | None = "output"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type.startswith("tuple") and not (
                isinstance(value, tuple) and all(isinstance(v, str) for v in value)
            ):
                raise TypeError(
                    f"DenseNames.{f.name} must be a tuple of module names, got {value!r}; "
                    f"for one name write ({value!r},)"
                )


def _lookup(model: nn.Module, name: str, field: str, kinds: tuple[type, ...] = ()) -> nn.Module:
    """``model.get_submodule(name)``, or a ``ValueError``/``TypeError`` that names the fix."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        parent, _, _ = name.rpartition(".")
        try:
            children = [n for n, _ in model.get_submodule(parent).named_children()]
        except AttributeError:
            children = [n for n, _ in model.named_children()]
        raise ValueError(
            f"dense_tp_plan: {type(model).__name__} has no module {name!r} (DenseNames.{field}); "
            f"the children there are {children}. Pass names=DenseNames({field}=...) with your "
            f"model's name, or None to leave it alone"
        ) from None
    if kinds and not isinstance(module, kinds):
        raise TypeError(
            f"dense_tp_plan: {name!r} (DenseNames.{field}) is of type {type(module).__name__}, but "
            f"torch's tensor-parallel styles shard only {' or '.join(k.__name__ for k in kinds)}"
        )
    return module


def dense_tp_plan(
    model: nn.Module, *, sequence_parallel: bool, names: DenseNames = DenseNames()
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of the dense layers of ``model``, keyed by FQN.

    See Note [Dense plan and the residual stream]. No collective: every name is looked up
    first, so a wrong name raises on every rank before anything is sharded.

    Keyword Args:
        sequence_parallel: the residual stream is a ``Shard(1)`` DTensor on the tp mesh
            (``True``) or a plain tensor, the same on every tp rank (``False``). Pass the same
            value to :func:`~dtensor_moe.parallel.parallelize_moe`.
        names: where the layers are; the defaults match the demo model.

    Returns:
        A dict from module name to style, for ``parallelize_module(model, tp_mesh, plan)``.

    Raises:
        TypeError: ``names`` is not a :class:`DenseNames`, or a name points at a module of a
            kind the style cannot shard.
        ValueError: a name that is not a module of ``model``.
    """
    if not isinstance(names, DenseNames):
        raise TypeError(f"dense_tp_plan: names must be a DenseNames, got {type(names).__name__}")
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if names.embedding is not None:
        _lookup(model, names.embedding, "embedding", (nn.Embedding,))
        plan[names.embedding] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel
        )
    blocks = [n for n, _ in _lookup(model, names.layers, "layers").named_children()]
    for block in blocks:
        prefix = f"{names.layers}.{block}."
        for name in names.gathered:
            _lookup(model, prefix + name, "gathered")
            if sequence_parallel:
                plan[prefix + name] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                )
        colwise_input = Replicate() if names.gathered else seq
        for name in names.colwise:
            _lookup(model, prefix + name, "colwise", (nn.Linear,))
            plan[prefix + name] = ColwiseParallel(input_layouts=colwise_input)
        for name in names.rowwise:
            _lookup(model, prefix + name, "rowwise", (nn.Linear,))
            plan[prefix + name] = RowwiseParallel(
                output_layouts=seq, use_local_output=not sequence_parallel
            )
        for name in names.norms:
            _lookup(model, prefix + name, "norms")
            if sequence_parallel:
                plan[prefix + name] = SequenceParallel()
    if names.final_norm is not None:
        _lookup(model, names.final_norm, "final_norm")
        if sequence_parallel:
            plan[names.final_norm] = SequenceParallel()
    if names.output is not None:
        _lookup(model, names.output, "output", (nn.Linear,))
        plan[names.output] = ColwiseParallel(
            input_layouts=seq, output_layouts=Replicate(), use_local_output=True
        )
    return plan


def parallelize_dense(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    names: DenseNames = DenseNames(),
) -> nn.Module:
    """Shard the dense layers of ``model`` over ``tp_mesh`` in place: :func:`dense_tp_plan`
    applied with ``parallelize_module``.

    Call it before :func:`~dtensor_moe.parallel.parallelize_moe` and
    :func:`~dtensor_moe.parallel.fully_shard_moe`, with the same ``sequence_parallel``.

    Args:
        model: the single-device model.
        tp_mesh: the 1-D tensor-parallel mesh, ``meshes.dense["tp"]``.

    Keyword Args:
        sequence_parallel: see :func:`dense_tp_plan`.
        names: see :class:`DenseNames`.

    Returns:
        ``model``. Collectives when applied: torch's styles scatter (or broadcast) each weight
        from the first rank of ``tp_mesh`` (``distribute_tensor``). In forward, per block: an
        all-gather of the attention input and a reduce-scatter of its output under sequence
        parallelism, or one all-reduce of the attention output without it; and at the ends the
        embedding's reduce-scatter (all-reduce) and the head's all-gather of the logits.
        Backward runs the mirror collectives.

    Example::

        meshes = build_moe_meshes(dp=2, tp=2, ep=4)
        parallelize_dense(model, meshes.dense["tp"], sequence_parallel=True)
        parallelize_moe(model, meshes, sequence_parallel=True)
        fully_shard_moe(model, meshes, blocks=model.layers)
    """
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_dense needs the 1-D tensor-parallel mesh (meshes.dense['tp']), got "
            f"{tp_mesh!r}"
        )
    plan = dense_tp_plan(model, sequence_parallel=sequence_parallel, names=names)
    return parallelize_module(model, tp_mesh, plan)
