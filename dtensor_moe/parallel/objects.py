"""Gathering small Python objects from every rank, without numpy.

Note [Object collectives without numpy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch 2.13's ``all_gather_object`` and ``gather_object`` turn the received bytes back into
objects through ``tensor.numpy()``, so they raise ``RuntimeError: Numpy is not available`` when
numpy is not installed. numpy is not a dependency of dtensor_moe (``pip install .`` brings torch
only), yet applying ``ExpertParallel`` and the demo's single-process comparison gather objects.
:func:`all_gather_objects` does the same job with public collectives only: one ``all_gather`` of
the pickled sizes, then one ``all_gather`` of the pickles padded to the largest; the bytes come
back through ``tensor.tolist()``. That is two collectives, as in torch's own function, and it is
meant for small objects (configurations, error messages, a few hundred step records): the
``tolist()`` round trip costs about a microsecond per byte.

As with torch's object collectives, the payload is unpickled: gather only from ranks of your own
job.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects"]


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return device


def all_gather_objects(
    obj: Any,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[Any]:
    """Every rank's ``obj``, in group-rank order, on every rank of ``group``.

    Like ``torch.distributed.all_gather_object``, but without numpy (Note [Object collectives
    without numpy]). ``device`` is where the byte tensors travel: ``"cpu"`` for gloo, the
    accelerator (``"cuda"`` means the current CUDA device) for NCCL.

    Communication: two ``all_gather`` calls over ``group``; none when it has one rank.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    device = _device(device)
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffer = buffer.to(device)
    received = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(received, buffer, group=group)
    return [
        pickle.loads(bytes(t[:n].tolist()))  # noqa: S301 (as torch's object collectives)
        for t, n in zip(received, lengths)
    ]
