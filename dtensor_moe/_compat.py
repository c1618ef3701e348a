"""The one module that touches private torch internals, bar the allowlist below.

When a torch release moves one of the internals, this module (helpers and allowlist) is what to
update. Each helper names the torch 2.13 internal it relies on.

Note [Private torch names outside _compat]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every other module of dtensor_moe uses public torch API, except for the names listed here, each
only in the module named on its line. A listed name also covers the names under it (a private
module covers its functions). These are ops and functions that the code calls directly, with no
public equivalent in torch 2.13; a helper here would only rename them.

    dtensor_moe/routed/kernels.py: torch._grouped_mm -- the grouped expert matmul
    dtensor_moe/routed/exchange.py: torch.distributed._functional_collectives -- the
        all-gather of the identical-tokens check (all_gather_single)
    dtensor_moe/routed/all_gather.py: torch.distributed._functional_collectives -- the
        all-gather exchange's collectives, differentiable and traceable (all_gather_single,
        all_gather_single_autograd, reduce_scatter_single_autograd, wait_tensor)
    dtensor_moe/routed/fixed.py: torch.distributed._functional_collectives -- the fixed-buffer
        exchange's static all-to-alls, traceable (all_to_all_single, wait_tensor), and the
        buffer-size agreement (all_gather_single)
    dtensor_moe/demo/train.py: torch._dynamo.utils.counters -- dynamo's graph, break and
        frame counts, which the demo reports under --compile (torch has no public reader)
    dtensor_moe/moe/losses.py: torch.distributed._functional_collectives -- the all-reduce of
        the global-batch router statistics (traceable under torch.compile)
    dtensor_moe/parallel/token_parallel.py: torch.distributed._functional_collectives -- the
        all-gather of the routing table for expert capacity over a tp group (traceable)
    dtensor_moe/optim/clip.py: torch._foreach_norm -- as torch.nn.utils.clip_grad_norm_ uses it
    dtensor_moe/optim/clip.py: torch._foreach_mul_ -- as torch.nn.utils.clip_grad_norm_ uses it
    dtensor_moe/optim/fused.py: torch._ops.OpOverload -- the type of the aten overloads
    dtensor_moe/optim/scaler.py: torch.ops.aten._amp_foreach_non_finite_check_and_unscale_ --
        the GradScaler op whose DTensor handler scaler.py installs

``tests/test_private_api.py`` parses the lines of the form ``<module>: <torch name>`` above and
scans every module of the package with ``ast`` for torch names with a private segment
(``torch._x``, ``from torch._x import y``, ``import torch.distributed._x``, ``DTensor._x`` after
``from torch.distributed.tensor import DTensor``, ``getattr(torch, "_x")``, aliases such as
``aten = torch.ops.aten``). A name that is not listed for its module fails the test, and so does
a listed name that its module no longer uses. Names built at run time are out of an ``ast``
scan's reach; these are all of them (kept in this form so that the test's parser skips them):

    - dtensor_moe/optim/fused.py, by name: the 24 overloads of ``torch.ops.aten._fused_adam_``,
      ``_fused_adam``, ``_fused_adamw_``, ``_fused_adamw``, ``_fused_sgd_``, ``_fused_sgd``,
      ``_fused_adagrad_`` and ``_fused_adagrad`` (``getattr(aten, name)`` over ``FUSED_OPS``'s
      names): the ops whose DTensor handler it installs.
    - dtensor_moe/optim/fused.py, by name (``getattr(torch, name)`` in ``fused_op_layout``):
      ``torch._fused_adam_``, ``torch._fused_adamw_``, ``torch._fused_sgd_``,
      ``torch._fused_adagrad_``: torch's Python bindings of the in-place ops, which the handler
      calls on local tensors (read, never replaced).
    - dtensor_moe/optim/scaler.py, by definition: its ``GradScaler`` subclass overrides
      ``torch.amp.GradScaler._unscale_grads_`` (the per-(device, dtype) inf check that both
      ``unscale_`` and ``step`` run) and calls torch's through :func:`grad_scaler_unscale_grads`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "DTensorSpec",
    "clear_sharding_prop_cache",
    "contiguous_stride",
    "custom_op_handlers",
    "device_has_foreach_support",
    "dtensor_from_local_spec",
    "dtensor_specs",
    "flatten_mesh",
    "fsdp_reshards_after_forward",
    "grad_scaler_unscale_grads",
    "in_backward_pass",
    "in_pipeline_metadata_inference",
    "in_pipeline_stage_forward",
    "is_pipeline_runtime",
    "local_tensor",
    "local_tensors",
    "functorch_active",
    "local_views",
    "replace_dtensor_storage",
    "running_perform_action",
    "schedule_microbatches",
    "schedule_stages",
    "stage_microbatch_rows",
    "runtime_defines_perform_action",
    "schema_of",
    "spec_of",
    "splits_tensor",
    "wait_stage_input",
]

OpHandler = Callable[[torch._ops.OpOverload, tuple, dict], Any]


def custom_op_handlers() -> dict[torch._ops.OpOverload, OpHandler]:
    """The live ``op -> handler`` table that DTensor consults before sharding propagation.

    ``DTensor._op_dispatcher._custom_op_handlers`` (torch 2.13). The C++ dispatch fast path
    checks this table too, so a handler here skips sharding propagation entirely.
    """
    return DTensor._op_dispatcher._custom_op_handlers


def schema_of(op: torch._ops.OpOverload) -> torch._C.FunctionSchema:
    """``OpOverload._schema``: argument names, types and positions of an aten overload."""
    return op._schema


def clear_sharding_prop_cache() -> None:
    """Drop the Python sharding-propagation cache and this thread's C++ one (torch 2.13).

    The same two calls as ``torch.distributed.tensor.debug._clear_sharding_prop_cache``, made
    directly: importing ``torch.distributed.tensor.debug`` imports numpy (through its sharding
    visualizer), which is not a dependency of torch or of dtensor_moe. The C++ cache is per
    thread: other threads keep theirs. Call it only between DTensor ops, never from code that
    can run inside one (a GC or weakref callback, ``__del__``, a handler): a clear during a
    lookup on the same thread crashes the process. The package itself never calls it; see Note
    [Registration leaves torch's sharding cache alone] in ``dtensor_moe/optim/fused.py``.
    """
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def spec_of(t: DTensor) -> DTensorSpec:
    """``DTensor._spec``: the mesh, placements and global metadata, without a copy."""
    return t._spec


def local_tensor(t: DTensor) -> torch.Tensor:
    """``DTensor._local_tensor``: the local shard, without the autograd-aware ``to_local``."""
    return t._local_tensor


def dtensor_from_local_spec(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """Wrap ``local`` as a DTensor with exactly ``spec`` (no checks, no communication).

    The caller guarantees that ``local`` is this rank's shard of a tensor described by ``spec``.
    """
    return DTensor(local, spec, requires_grad=False)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as torch does)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _LocalViews(torch.autograd.Function):
    """Local tensors of several DTensors in one node; backward wraps each gradient with a spec.

    The forward returns ``t._local_tensor.view_as(...)`` like ``DTensor.to_local``; the backward
    wraps each (contiguous) local gradient with its precomputed gradient spec, which is what
    ``to_local(grad_placements=...)``'s backward builds, minus the per-call spec construction.
    """

    @staticmethod
    def forward(ctx: Any, grad_specs: tuple[DTensorSpec, ...], *ts: DTensor) -> tuple:
        ctx.grad_specs = grad_specs
        return tuple(t._local_tensor.view_as(t._local_tensor) for t in ts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        # Under create_graph=True (Note [Double backward] in dtensor_moe/routed/layouts.py) the
        # direct wrap would cut the graph, so it wraps differentiably, as to_local's backward.
        wrap = _wrap_with_graph if torch.is_grad_enabled() else dtensor_from_local_spec
        pairs = zip(grads, ctx.grad_specs)
        return None, *(None if g is None else wrap(g.contiguous(), spec) for g, spec in pairs)


def _wrap_with_graph(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


# Note [Gradient-spec cache]
# ``local_views`` wraps each local gradient with a spec made of the DTensor's mesh and tensor
# metadata and the gradient placements. A parameter keeps its spec object step after step, so
# that gradient spec is built once per (spec, gradient placements) and remembered:
#   key:      ``id(spec)`` -> (weak reference to the spec, {gradient placements: gradient spec})
#   bound:    one entry per live spec that went through ``local_views``; a few placements each
#   lifetime: the spec's: the weak reference's callback drops the entry when the spec dies.
# A gradient spec holds the mesh and the tensor metadata, never the spec or a tensor, so the
# cache keeps nothing alive that the DTensor would not. ``_GRAD_SPECS.clear()`` is safe at any
# time (``dtensor_moe.clear_caches``).
_GRAD_SPECS: dict[int, tuple[weakref.ref, dict[tuple, DTensorSpec]]] = {}


def _grad_spec(t: DTensor, grad_placements: tuple) -> DTensorSpec | None:
    spec = t._spec
    entry = _GRAD_SPECS.get(id(spec))
    if entry is not None and entry[0]() is spec:
        hit = entry[1].get(grad_placements)
        if hit is not None:
            return hit
    meta = spec.tensor_meta
    if not t._local_tensor.is_contiguous() or meta is None:
        return None
    # A contiguous local gradient has the global stride of a contiguous tensor (what torch's
    # to_local backward computes from it); the parameter's own stride is that when it is
    # contiguous, which ``distribute_tensor`` produces.
    if tuple(meta.stride) != contiguous_stride(meta.shape):
        return None
    grad_spec = DTensorSpec(spec.mesh, grad_placements, tensor_meta=meta)
    if entry is None or entry[0]() is not spec:
        entry = (weakref.ref(spec, _grad_spec_dropper(id(spec))), {})
        _GRAD_SPECS[id(spec)] = entry
    entry[1][grad_placements] = grad_spec
    return grad_spec


def _grad_spec_dropper(key: int) -> Callable[[weakref.ref], None]:
    """The callback that removes ``_GRAD_SPECS[key]`` when its spec dies (and no newer entry)."""

    def drop(dead: weakref.ref) -> None:
        entry = _GRAD_SPECS.get(key)
        if entry is not None and entry[0] is dead:
            del _GRAD_SPECS[key]

    return drop


def local_views(ts: tuple[DTensor, ...], grad_placements: tuple[tuple, ...]) -> tuple:
    """``tuple(t.to_local(grad_placements=g) for t, g in zip(ts, grad_placements))``, cheaper.

    One autograd node for all of them and cached gradient specs; falls back to ``to_local``
    when a local tensor or the global layout is not contiguous, and while ``torch.compile``
    traces.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot pass DTensorSpecs into a custom autograd.Function; ``to_local`` traces
        # and gives the same views and gradients.
        return tuple(t.to_local(grad_placements=list(g)) for t, g in zip(ts, grad_placements))
    specs = tuple(_grad_spec(t, g) for t, g in zip(ts, grad_placements))
    if any(s is None for s in specs):
        return tuple(t.to_local(grad_placements=list(g)) for t, g in zip(ts, grad_placements))
    return _LocalViews.apply(specs, *ts)


def replace_dtensor_storage(dst: DTensor, src: DTensor) -> None:
    """Make ``dst`` hold ``src``'s local tensor and spec (same global shape, new placements).

    Used to write a mutated optimizer argument back when its original placement (for example
    ``Partial``) cannot be reached again by ``redistribute``.
    """
    if dst.shape != src.shape:
        raise AssertionError(f"global shapes differ: {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst._local_tensor = src._local_tensor
    dst._spec = src._spec


def dtensor_specs(values: Sequence) -> list[DTensorSpec] | None:
    """The specs (``DTensor._spec``) of ``values`` if every entry is a DTensor, else ``None``.

    One list comprehension over the ``_spec`` slot, which CPython specializes: the fused
    optimizer handler's per-step pass (Note [Handler cost] in ``optim/fused.py``).
    """
    try:
        return [v._spec for v in values]
    except AttributeError:
        return None


def local_tensors(values: Sequence) -> list[torch.Tensor]:
    """The local tensors (``DTensor._local_tensor``) of a list of DTensors, in one pass."""
    return [v._local_tensor for v in values]


def device_has_foreach_support(device: torch.device) -> bool:
    """``torch.utils._foreach_utils._device_has_foreach_support``: can foreach kernels run here?"""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return _device_has_foreach_support(device)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ...) is running:
    ``torch._C._functorch.peek_interpreter_stack`` (torch 2.13) is not ``None``."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def in_backward_pass() -> bool:
    """Whether autograd is running a backward pass right now (``torch._C._current_graph_task_id``).

    It is ``-1`` outside a backward pass; torch's checkpoint code relies on the same call.
    """
    return torch._C._current_graph_task_id() != -1


def in_pipeline_stage_forward() -> bool:
    """Whether a ``torch.distributed.pipelining`` stage is running its module's forward.

    torch 2.13 keeps no state for it: a stage runs its module from
    ``_PipelineStageBase.forward_one_chunk``, so this looks for that method's frame on the
    Python stack. ``False`` at once when ``torch.distributed.pipelining.stage`` was never
    imported. Eager only (a frame walk); callers skip it under ``torch.compile``.
    """
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is None:
        return False
    return _on_stack({stage._PipelineStageBase.forward_one_chunk.__code__})


def in_pipeline_metadata_inference() -> bool:
    """Whether a ``torch.distributed.pipelining`` stage is running its metadata inference.

    torch 2.13's ``PipelineStage`` built without ``input_args``/``output_args`` runs, before its
    first step, one forward and one backward of its module from
    ``PipelineStage._forward_metadata_inference`` and ``_backward_metadata_inference`` (in
    training mode, on the first micro-batch on the first stage and on ``torch.empty`` buffers on
    the others) to learn the shapes it sends. It keeps no state for it, so this looks for those
    methods' frames on this thread's Python stack (a backward that the autograd engine runs on
    another thread, as on CUDA, is not seen). ``False`` at once when
    ``torch.distributed.pipelining.stage`` was never imported. Eager only (a frame walk).
    ``_shape_inference`` is the forward pass's name before torch 2.13.
    """
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    cls = None if stage is None else getattr(stage, "PipelineStage", None)
    if cls is None:
        return False
    names = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")
    return _on_stack({getattr(cls, name).__code__ for name in names if hasattr(cls, name)})


def _on_stack(codes: set) -> bool:
    """Whether a frame of one of ``codes`` is on this thread's Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def splits_tensor(placement) -> bool:
    """Whether ``placement`` splits the tensor across its mesh dim: ``Shard`` or ``_StridedShard``.

    torch 2.13's ``_StridedShard`` (what FSDP2 uses on top of a tp-sharded dim 0) is neither a
    ``Shard`` subclass nor ``is_shard()``, yet it partitions the elements like a shard.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def flatten_mesh(mesh):
    """A 1-D mesh over all ranks of ``mesh``, in row-major order (``DeviceMesh._flatten``).

    Used for the all-to-all of expert tensor parallelism over a 2-D ``(ep, etp)`` mesh. Torch
    creates the process groups of every such sub-mesh on every rank and caches the result, so
    calling it on each rank, in the same order, is safe and cheap after the first call.
    """
    return mesh if mesh.ndim == 1 else mesh._flatten()


def is_pipeline_runtime(schedule: object) -> bool:
    """Whether ``schedule`` runs a lowered action list with custom functions:
    ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime`` (torch 2.13), the base
    of ``ScheduleDualPipeV`` and the other multi-stage schedules."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return isinstance(schedule, _PipelineScheduleRuntime)


def runtime_defines_perform_action() -> bool:
    """Whether ``_PipelineScheduleRuntime._step_microbatches`` (torch 2.13) still defines the
    local ``_perform_action`` that :func:`running_perform_action` reads."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return "_perform_action" in _PipelineScheduleRuntime._step_microbatches.__code__.co_varnames


def running_perform_action(schedule: object) -> Callable[[Any], None] | None:
    """The function that ``schedule``'s running step calls for each action, or ``None``.

    ``_PipelineScheduleRuntime._step_microbatches`` (torch 2.13) defines it as the local closure
    ``_perform_action(action)``: the input wait, the stage's ``forward_one_chunk`` and loss, or
    ``backward_one_chunk``, the hand-over to the next stage on the same rank. A custom function
    registered with ``register_custom_function`` runs inside that method, so the closure is a
    local of one of the caller's frames (the one whose ``self`` is ``schedule``); torch passes
    it no other way.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_step_microbatches" and frame.f_locals.get("self") is schedule:
            perform = frame.f_locals.get("_perform_action")
            if callable(perform):
                return perform
        frame = frame.f_back
    return None


def wait_stage_input(schedule: object, action: Any) -> None:
    """Wait for what ``action`` (a forward or backward sub-action) receives from another pp rank,
    if it receives anything; the schedule then runs ``action`` without waiting.

    ``_PipelineScheduleRuntime`` (torch 2.13) keeps the posted receives in ``fwd_recv_ops`` /
    ``bwd_recv_ops``, keyed by ``(stage index, micro-batch index)``; its ``_perform_action``
    requires the key, waits for its works and removes it. The works are waited for here and
    replaced by an empty list: gloo's receive work waits for one more message when waited for
    twice.
    """
    from torch.distributed.pipelining.schedules import FORWARD

    ops = schedule.fwd_recv_ops if action.computation_type == FORWARD else schedule.bwd_recv_ops
    key = (action.stage_index, action.microbatch_index)
    if key in ops:
        for work in ops[key]:
            work.wait()
        ops[key] = []


def schedule_stages(schedule: object) -> list:
    """The stages ``schedule`` runs on this rank: ``_stage`` of a single-stage schedule,
    ``_stages`` of a multi-stage one (``torch.distributed.pipelining.schedules``, torch 2.13)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        if stage is None:
            raise TypeError(
                f"expected a torch.distributed.pipelining schedule, got {type(schedule).__name__}"
            )
        stages = [stage]
    return list(stages)


def schedule_microbatches(schedule: object) -> int:
    """``_PipelineSchedule._n_microbatches`` (torch 2.13): the micro-batches of one step."""
    return int(schedule._n_microbatches)


def stage_microbatch_rows(stage: object) -> int | None:
    """The rows (dim 0) of one micro-batch in a ``PipelineStage``'s static input metadata
    (``_user_meta.inputs``, torch 2.13), or ``None`` when the stage was built without it."""
    meta = getattr(stage, "_user_meta", None)
    inputs = None if meta is None else meta.inputs
    if not inputs or len(inputs[0].shape) == 0:
        return None
    return int(inputs[0].shape[0])


def fsdp_reshards_after_forward(module: torch.nn.Module, *, root: bool) -> bool:
    """Whether the ``fully_shard`` module ``module`` frees its gathered params after forward.

    torch 2.13 keeps it per param group of ``module._get_fsdp_state()``: ``post_forward_mesh_info``
    is ``None`` when the group stays gathered. A root sharded with the default
    ``reshard_after_forward=None`` (``_auto_reshard_after_forward``) stops resharding at its
    lazy init, so it counts as not resharding even before its first forward.
    """
    state = module._get_fsdp_state()
    if root and state._auto_reshard_after_forward:
        return False
    return any(group.post_forward_mesh_info is not None for group in state._fsdp_param_groups)


def grad_scaler_unscale_grads(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> dict[torch.device, torch.Tensor]:
    """torch 2.13's ``GradScaler._unscale_grads_``: the inf check (and unscale) of every grad of
    ``optimizer``, one ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group;
    returns ``found_inf`` per device."""
    return torch.amp.GradScaler._unscale_grads_(scaler, optimizer, inv_scale, found_inf, allow_fp16)
