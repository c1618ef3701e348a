"""A compiled ``opt.step()`` of a fused optimizer over params on several meshes.

torch never traces a fused optimizer: dynamo wraps ``torch.optim.adam._fused_adam`` and its
SGD/Adagrad twins in ``torch.compiler.disable`` when it starts, so under ``torch.compile`` the
fused kernel call (and everything of dtensor_moe it reaches) runs eagerly, and the code around
it is traced. These tests pin what that gives over DTensor params on three meshes (plus a plain
param in the same group), for every fused optimizer: the params and optimizer state of torch
alone stepping the local shards eagerly, bit for bit, over 3 steps, with no collective and one
call of the handler per step; the graph breaks and frames; a misaligned slot redistributed on
its own mesh; and the errors (a cross-mesh slot, ``fullgraph=True``), raised before any param or
state tensor is changed. See "torch.compile" in docs/optimizers.md.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe  # noqa: F401  (registers the handlers)
from tests._dist import DistTestBase
from tests._optim_cases import (
    build_meshes,
    distribute,
    full_grads,
    full_params,
    handler_calls,
    partial_grad,
)

STEPS = 3
# one case per fused optimizer; SGD with momentum so that it has a state to compare
CASES = {
    "Adam": {"lr": 0.01, "amsgrad": True},
    "AdamW": {"lr": torch.tensor(0.01), "weight_decay": 0.05},
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    "Adagrad": {"lr": 0.1, "lr_decay": 0.01},
}
# (optimizer, how). how: 'method' is torch.compile(opt.step), 'function' a compiled function
# that calls opt.step() (Adam's function form is AdamW's: AdamW inherits Adam.step).
MAIN_CASES = [(c, "method") for c in CASES] + [
    (c, "function") for c in ("AdamW", "SGD", "Adagrad")
]
INDUCTOR_CASE = ("Adagrad", "function")  # every other case compiles with aot_eager


# three of the layouts of tests/_optim_cases.py, one per mesh: Shard(0) on the world mesh (7
# rows over 4 ranks), Shard(0) on the tp sub-mesh (7 rows over 2), [Shard(0), Shard(1)] on the
# 2-D mesh. Few tensors keep dynamo's tracing short.
_SLOTS = (0, 3, 5)


def _pick(tensors: list) -> list:
    return [tensors[i] for i in _SLOTS]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _make_optimizer(cls_name: str, params: list) -> torch.optim.Optimizer:
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v
              for k, v in CASES[cls_name].items()}
    return getattr(torch.optim, cls_name)(params, fused=True, **kwargs)


def _counts() -> tuple[int, int, int]:
    """(graphs, graph breaks, frames) that dynamo has seen since ``counters.clear()``."""
    return (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["frames"]["total"],
    )


def _warm_up_dynamo() -> None:
    """Compile one tiny fused step in the parent process, so that every forked rank starts with
    dynamo and its backends imported (a test's first compile otherwise costs ~1 s per rank)."""
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        torch.compile(opt.step, backend=backend)()
    torch._dynamo.reset()
    counters.clear()


def _collectives(meshes) -> dict[str, int]:
    """How many collectives each process group of ``meshes`` has issued so far.

    Read from the groups' sequence numbers, not from ``CommDebugMode``: dynamo does not compile
    frames while a torch dispatch mode is active, so under ``CommDebugMode`` a "compiled" step
    would silently run eagerly.
    """
    groups = {"world": meshes["world"].get_group(), "dp": meshes["2d"].get_group("dp"),
              "tp": meshes["2d"].get_group("tp")}
    return {name: pg._get_sequence_number_for_group() for name, pg in groups.items()}


class CompiledFusedStepTest(DistTestBase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        _warm_up_dynamo()

    def _params(self, meshes, layout: str) -> list:
        """Params on three meshes plus a plain param ("mixed"), all on one mesh, or plain."""
        full = _pick(full_params())
        if layout == "mixed":
            return [p.requires_grad_() for p in _pick(distribute(full_params(), meshes))] + [
                torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
            ]
        if layout == "one_mesh":
            return [distribute_tensor(t, meshes["world"], [Replicate()]).requires_grad_()
                    for t in full]
        return [torch.nn.Parameter(t) for t in full]

    def _set_grads(self, meshes, params: list, step: int, layout: str = "mixed") -> None:
        full = _pick(full_grads(step))
        if layout == "mixed":  # the last param is plain
            grads = _pick(distribute(full_grads(step), meshes)) + [
                torch.full((2, 3), 0.5 * (step + 1))
            ]
        elif layout == "one_mesh":
            grads = [distribute_tensor(g, meshes["world"], [Replicate()]) for g in full]
        else:
            grads = full
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    def _compiled(self, opt, how: str, backend: str = "aot_eager", fullgraph: bool = False):
        """``how``: 'method' (``torch.compile(opt.step)``) or 'function' (a compiled function
        that calls ``opt.step()``)."""
        if how == "method":
            return torch.compile(opt.step, backend=backend, fullgraph=fullgraph)

        @torch.compile(backend=backend, fullgraph=fullgraph)
        def step():
            opt.step()

        return step

    def _compiled_steps(self, meshes, cls_name: str, how: str, layout: str = "mixed",
                        backend: str = "aot_eager"):
        """Step a fresh optimizer 3 times through a compiled step, beside torch alone (eager)
        on plain copies of this rank's local shards: the reference runs no code of ours.
        Returns (params, opt, ref, ref_opt) and the (graphs, graph breaks, frames) after each
        step. Every compiled step must issue no collective and, where a param is a DTensor,
        reach the handler once."""
        torch._dynamo.reset()
        counters.clear()
        params = self._params(meshes, layout)
        opt = _make_optimizer(cls_name, params)
        step = self._compiled(opt, how, backend)
        ref = [torch.nn.Parameter(_local(p.detach()).clone()) for p in params]
        local_grads, per_step = [], []
        for i in range(STEPS):
            self._set_grads(meshes, params, i, layout)
            local_grads.append([_local(p.grad).clone() for p in params])
            before = _collectives(meshes)
            with handler_calls() as calls:
                step()
            self.assertEqual(_collectives(meshes), before, f"{cls_name} {layout}: collectives")
            self.assertEqual(sum(calls.values()), int(layout != "plain"), f"{cls_name} {layout}")
            per_step.append(_counts())
        ref_opt = _make_optimizer(cls_name, ref)
        for grads in local_grads:
            for r, g in zip(ref, grads):
                r.grad = g
            ref_opt.step()
        return (params, opt, ref, ref_opt), per_step

    def _assert_matches_reference(self, params, opt, ref, ref_opt, where: str) -> None:
        """Params and every optimizer state tensor, bit for bit; DTensor state keeps its
        param's mesh and placements."""
        for i, (p, r) in enumerate(zip(params, ref)):
            self.assertEqual(_local(p.detach()), r.detach(), atol=0, rtol=0,
                             msg=f"{where}: param {i}")
            state, ref_state = opt.state[p], ref_opt.state[r]
            self.assertEqual(sorted(state), sorted(ref_state), msg=f"{where}: state {i}")
            for key, ref_value in ref_state.items():
                value = state[key]
                if isinstance(p, DTensor) and value.dim() > 0:
                    self.assertIsInstance(value, DTensor)
                    self.assertEqual((value.device_mesh, value.placements),
                                     (p.device_mesh, p.placements), msg=f"{where}: {key} {i}")
                self.assertEqual(_local(value), ref_value, atol=0, rtol=0,
                                 msg=f"{where}: {key} of param {i}")

    @with_comms
    def test_compiled_step_matches_eager_torch(self):
        meshes = build_meshes(self.device_type)
        counts = {}
        for cls_name, how in MAIN_CASES:
            backend = "inductor" if (cls_name, how) == INDUCTOR_CASE else "aot_eager"
            where = f"{cls_name} {how} {backend}"
            run, counts[where] = self._compiled_steps(meshes, cls_name, how, backend=backend)
            self._assert_matches_reference(*run, where)
        # (graphs, graph breaks, frames) after each of the 3 steps. No graph: dynamo disables
        # torch.optim's _fused_adam & co., so every fused step runs eagerly, and torch's
        # _use_grad breaks the graph around the step body. Nothing is recompiled after step 1,
        # except that SGD's first step (no momentum buffer yet) takes another branch than the
        # later ones. These are torch's own counts: tests/test_optim_no_harm.py checks that a
        # plain-tensor step has them without dtensor_moe.
        self.assertExpectedInline(
            "\n".join(f"{k}: {v}" for k, v in counts.items()),
            """\
Adam method aot_eager: [(0, 3, 12), (0, 3, 12), (0, 3, 12)]
AdamW method aot_eager: [(0, 3, 12), (0, 3, 12), (0, 3, 12)]
SGD method aot_eager: [(0, 2, 10), (0, 3, 11), (0, 3, 11)]
Adagrad method aot_eager: [(0, 2, 10), (0, 2, 10), (0, 2, 10)]
AdamW function aot_eager: [(0, 4, 14), (0, 4, 14), (0, 4, 14)]
SGD function aot_eager: [(0, 3, 12), (0, 4, 13), (0, 4, 13)]
Adagrad function inductor: [(0, 3, 12), (0, 3, 12), (0, 3, 12)]""",
        )
        # the same for params all on one mesh, and for plain params (no DTensor at all)
        for layout in ("one_mesh", "plain"):
            run, per_step = self._compiled_steps(meshes, "AdamW", "method", layout)
            self._assert_matches_reference(*run, f"AdamW {layout}")
            self.assertEqual(per_step, counts["AdamW method aot_eager"], layout)

    @with_comms
    def test_misaligned_slot_is_redistributed_under_compile(self):
        # slot 0 (Shard(0) on the world mesh) gets a Partial grad: a reduce-scatter on that
        # mesh inside the compiled step, as in the eager one (test_fused_optim_dist.py)
        meshes = build_meshes(self.device_type)
        params = self._params(meshes, "mixed")
        opt = _make_optimizer("AdamW", params)
        step = self._compiled(opt, "method")
        ref = [p.detach().clone().requires_grad_() for p in params]  # eager, same layout
        ref_opt = _make_optimizer("AdamW", ref)
        for i in range(STEPS):
            for ps in (params, ref):
                self._set_grads(meshes, ps, i)
                ps[0].grad = partial_grad(full_grads(i)[0], meshes["world"], self.rank,
                                          self.world_size)
            before = _collectives(meshes)
            step()
            issued = {k: n - before[k] for k, n in _collectives(meshes).items()}
            self.assertEqual(issued, {"world": 1, "dp": 0, "tp": 0}, f"step {i}")
            ref_opt.step()
        # the compiled step steps exactly like the eager one ...
        for i, (p, r) in enumerate(zip(params, ref)):
            self.assertEqual(_local(p.detach()), _local(r.detach()), atol=0, rtol=0,
                             msg=f"param {i}")
            for key, value in ref_opt.state[r].items():
                self.assertEqual(_local(opt.state[p][key]), _local(value), atol=0, rtol=0,
                                 msg=f"{key} of param {i}")
        # ... and like torch alone on the full tensors, to the tolerance of
        # test_fused_optim_dist.py (the Partial pieces sum in another order)
        full = [torch.nn.Parameter(t) for t in _pick(full_params())]
        full_opt = _make_optimizer("AdamW", full)
        for i in range(STEPS):
            for f, g in zip(full, _pick(full_grads(i))):
                f.grad = g
            full_opt.step()
        for i, (p, f) in enumerate(zip(params[:-1], full, strict=True)):
            self.assertLessEqual((p.detach().full_tensor() - f.detach()).abs().max().item(), 1e-6,
                                 f"param {i}")

    @with_comms
    def test_cross_mesh_slot_raises_before_the_kernel(self):
        meshes = build_meshes(self.device_type)
        for compiled in (False, True):  # the compiled step fails exactly as the eager one
            torch._dynamo.reset()
            params = self._params(meshes, "mixed")
            opt = _make_optimizer("Adam", params)
            step = self._compiled(opt, "method") if compiled else opt.step
            self._set_grads(meshes, params, 0)
            step()  # one good step creates the state
            before = [_local(p.detach()).clone() for p in params]
            state_before = [{k: _local(v).clone() for k, v in opt.state[p].items()}
                            for p in params]
            self._set_grads(meshes, params, 1)
            # slot 1 lives on the tp sub-mesh; give it a grad on the world mesh instead
            params[1].grad = distribute_tensor(_pick(full_grads(1))[1], meshes["world"],
                                               [Replicate()])
            # slot 0 needs a reduce-scatter, which must not start before the error is found
            params[0].grad = partial_grad(full_grads(1)[0], meshes["world"], self.rank,
                                          self.world_size)
            collectives = _collectives(meshes)
            with self.assertRaisesRegex(
                ValueError,
                r"slot 1 of 'grads' does not follow param 1: it is on a different device mesh.*"
                r"param 1 is a DTensor on DeviceMesh\(.*tp.*'grads'\[1\] is a DTensor on "
                r"DeviceMesh\(.*world",
            ):
                step()
            self.assertEqual(_collectives(meshes), collectives, f"compiled={compiled}")
            for i, p in enumerate(params):
                self.assertEqual(_local(p.detach()), before[i], atol=0, rtol=0)
                for key, value in state_before[i].items():
                    # torch.optim counts the step before it calls the kernel (eager too)
                    want = value + 1 if key == "step" else value
                    self.assertEqual(_local(opt.state[p][key]), want, atol=0, rtol=0,
                                     msg=f"compiled={compiled}: {key} of param {i}")
            dist.barrier()  # every rank raised; nothing hangs

    @with_comms
    def test_fullgraph_raises_before_stepping(self):
        # torch's own error, the same for plain params: torch.optim breaks the graph on purpose
        meshes = build_meshes(self.device_type)
        for layout in ("mixed", "plain"):
            torch._dynamo.reset()
            params = self._params(meshes, layout)
            opt = _make_optimizer("SGD", params)
            self._set_grads(meshes, params, 0, layout)
            before = [_local(p.detach()).clone() for p in params]
            step = self._compiled(opt, "method", fullgraph=True)
            with self.assertRaisesRegex(
                torch._dynamo.exc.Unsupported, r"Call to `torch._dynamo.graph_break\(\)`"
            ):
                step()
            self.assertEqual(len(opt.state), 0, layout)
            for p, b in zip(params, before):
                self.assertEqual(_local(p.detach()), b, atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
