"""The one module that touches private torch internals.

Every other module of dtensor_moe uses public API only. When a torch release moves one of the
pieces below, this is the file to update. Each helper names the torch 2.13 internal it relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "DTensorSpec",
    "clear_sharding_prop_cache",
    "custom_op_handlers",
    "device_has_foreach_support",
    "dtensor_from_local_spec",
    "local_tensor",
    "locals_if_aligned",
    "replace_dtensor_storage",
    "spec_of",
]

OpHandler = Callable[[torch._ops.OpOverload, tuple, dict], Any]


def custom_op_handlers() -> dict[torch._ops.OpOverload, OpHandler]:
    """The live ``op -> handler`` table that DTensor consults before sharding propagation.

    ``DTensor._op_dispatcher._custom_op_handlers`` (torch 2.13). The C++ dispatch fast path
    checks this table too, so a handler here skips sharding propagation entirely.
    """
    return DTensor._op_dispatcher._custom_op_handlers


def clear_sharding_prop_cache() -> None:
    """Drop the Python and C++ sharding-propagation caches after changing a rule or handler."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


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


def replace_dtensor_storage(dst: DTensor, src: DTensor) -> None:
    """Make ``dst`` hold ``src``'s local tensor and spec (same global shape, new placements).

    Used to write a mutated optimizer argument back when its original placement (for example
    ``Partial``) cannot be reached again by ``redistribute``.
    """
    if dst.shape != src.shape:
        raise AssertionError(f"global shapes differ: {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst._local_tensor = src._local_tensor
    dst._spec = src._spec


def locals_if_aligned(
    params: list, values: list, specs_out: list | None
) -> list[torch.Tensor] | None:
    """Local tensors of ``values`` if no slot needs redistribution or a careful check.

    A slot passes when it is a DTensor on its param's mesh with its param's placements, a plain
    0-dim tensor, or a plain tensor next to a plain param.

    This is the hot path of a fused optimizer step: one pass over private attributes with
    identity checks first. Returns ``None`` (and leaves ``specs_out`` untouched) as soon as any
    slot needs the careful per-slot treatment.
    """
    local = []
    specs = []
    for param, value in zip(params, values):
        if type(value) is DTensor:
            if type(param) is not DTensor:
                return None
            v_spec, p_spec = value._spec, param._spec
            if v_spec.mesh is not p_spec.mesh or v_spec.placements != p_spec.placements:
                return None
            local.append(value._local_tensor)
            specs.append(v_spec)
        elif value.dim() == 0 or type(param) is not DTensor:
            # plain per-param scalars (torch.optim's ``state_steps``) and plain params
            local.append(value)
            specs.append(None)
        else:
            return None
    if specs_out is not None:
        specs_out.extend(specs)
    return local


def device_has_foreach_support(device: torch.device) -> bool:
    """Whether torch runs ``torch._foreach_*`` kernels on ``device`` (cpu, cuda, xpu, ...).

    ``torch.utils._foreach_utils._device_has_foreach_support`` (torch 2.13), the same test
    ``torch.nn.utils.clip_grad_norm_`` uses to pick its foreach path.
    """
    from torch.utils._foreach_utils import _device_has_foreach_support

    return _device_has_foreach_support(device)
