"""For benchmarks/gpu.sh on a GPU machine whose torch is older than 2.13 (not the package).

With torch 2.11, eager functional collectives over gloo crash the process on CUDA tensors
(a segmentation fault in ``wait_tensor`` from the second collective on). On ``PYTHONPATH`` as
``sitecustomize``, this routes the eager functional all-gather, all-reduce and reduce-scatter of
CUDA tensors through c10d's collectives instead; the exchanges' own eager collectives are c10d
already, and nothing changes under ``torch.compile``. ``gpu.sh`` puts it on the path when
torch is older than 2.13. ``GLOO_CUDA_SHIM_ON_CPU=1`` applies it to CPU tensors too, to check
it on a machine without a GPU.
"""
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _f

if not hasattr(_f, "all_gather_single"):
    _f.all_gather_single = _f.all_gather_tensor
_orig = {n: getattr(_f, n) for n in ("all_gather_tensor", "all_gather_single", "all_reduce",
                                     "reduce_scatter_tensor")}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.SUM}


def _pg(group):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(_f._resolve_group_name(group, ""))


def _eager_cuda(t):
    return isinstance(t, torch.Tensor) and (t.is_cuda or os.environ.get("GLOO_CUDA_SHIM_ON_CPU") == "1") and not torch.compiler.is_compiling()


def _gather(self, gather_dim, group, tag=""):
    pg = _pg(group)
    n = dist.get_world_size(pg)
    parts = [torch.empty_like(self) for _ in range(n)]
    dist.all_gather(parts, self.contiguous(), group=pg)
    return torch.cat(parts, dim=gather_dim)


def all_gather_tensor(self, gather_dim, group, tag=""):
    if _eager_cuda(self):
        return _gather(self, gather_dim, group)
    return _orig["all_gather_tensor"](self, gather_dim, group, tag)


def all_gather_single(self, gather_dim, group, tag=""):
    if _eager_cuda(self):
        return _gather(self, gather_dim, group)
    return _orig["all_gather_single"](self, gather_dim, group, tag)


def all_reduce(self, reduceOp, group, tag=""):
    if _eager_cuda(self):
        out = self.clone()
        dist.all_reduce(out, op=_OPS[reduceOp.lower()], group=_pg(group))
        if reduceOp.lower() == "avg":
            out /= dist.get_world_size(_pg(group))
        return out
    return _orig["all_reduce"](self, reduceOp, group, tag)


def reduce_scatter_tensor(self, reduceOp, scatter_dim, group, tag=""):
    if _eager_cuda(self):
        pg = _pg(group)
        out = all_reduce(self, reduceOp, group)
        return out.chunk(dist.get_world_size(pg), dim=scatter_dim)[dist.get_rank(pg)].contiguous()
    return _orig["reduce_scatter_tensor"](self, reduceOp, scatter_dim, group, tag)


_f.all_gather_tensor, _f.all_gather_single = all_gather_tensor, all_gather_single
_f.all_reduce, _f.reduce_scatter_tensor = all_reduce, reduce_scatter_tensor
