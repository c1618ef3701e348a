"""Multi-process (gloo, 4 ranks) tests of fused optimizers over params on several meshes.

Every fused step here reaches dtensor_moe's DTensor handler through torch's own dispatch (the
tests count the calls): ``import dtensor_moe`` changes nothing else on the way.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

import dtensor_moe  # noqa: F401  (registers the handlers)
from tests._dist import DistTestBase
from tests._optim_cases import (
    OPTIM_CASES,
    build_meshes,
    distribute,
    full_grads,
    full_params,
    handler_calls,
    make_optimizer,
    partial_grad,
    plain_copies,
)

STEPS = 3
TOL = 1e-6


def _comm_counts(mode: CommDebugMode) -> dict:
    return {str(k): v for k, v in sorted(mode.get_comm_counts().items(), key=str)}


class FusedOptimizerAcrossMeshesTest(DistTestBase):
    def _reference(self, cls_name, kwargs, impl) -> list:
        """torch alone on the full tensors: plain params, no code of ours."""
        ref = [p.requires_grad_() for p in full_params()]
        opt_ref = make_optimizer(cls_name, ref, kwargs, impl)
        for step in range(STEPS):
            for p, g in zip(ref, full_grads(step)):
                p.grad = g
            opt_ref.step()
        return ref

    @with_comms
    def test_every_optimizer_matches_single_device(self):
        # Each case against torch alone on the full tensors (to TOL), and, for fused steps (all
        # elementwise), bit for bit against torch's fused kernel on plain copies of this rank's
        # local shards. Each fused step reaches the handler exactly once (one device and dtype),
        # with the in-place overload torch.optim picks; foreach and for-loop steps never do.
        meshes = build_meshes(self.device_type)
        for label, cls_name, kwargs in OPTIM_CASES:
            for impl in ("fused", "foreach", "forloop"):
                ref = self._reference(cls_name, kwargs, impl)
                dt = [p.detach().requires_grad_() for p in distribute(full_params(), meshes)]
                local = plain_copies(dt)
                opt_dt = make_optimizer(cls_name, dt, kwargs, impl)
                opt_local = make_optimizer(cls_name, local, kwargs, impl)
                with handler_calls() as calls:
                    for step in range(STEPS):
                        for p, g in zip(dt, distribute(full_grads(step), meshes)):
                            p.grad = g
                        opt_dt.step()
                for step in range(STEPS):
                    for p, g in zip(local, distribute(full_grads(step), meshes)):
                        p.grad = g.to_local()
                    opt_local.step()
                where = f"{label} ({impl})"
                if impl == "fused":
                    overload = "tensor_lr" if isinstance(kwargs["lr"], torch.Tensor) else "default"
                    want = {f"aten._fused_{cls_name.lower()}_.{overload}": STEPS}
                    self.assertEqual(dict(calls), want, where)
                    for d, p in zip(dt, local):
                        self.assertEqual(d.to_local(), p.detach(), atol=0, rtol=0, msg=where)
                    for d, p in zip(dt, local):
                        for key, value in opt_dt.state[d].items():
                            if isinstance(value, DTensor):  # the state keeps its param's layout
                                self.assertEqual((value.device_mesh, value.placements),
                                                 (d.device_mesh, d.placements), where)
                            self.assertEqual(value.to_local() if isinstance(value, DTensor)
                                             else value, opt_local.state[p][key],
                                             atol=0, rtol=0, msg=f"{where}: {key}")
                else:
                    self.assertEqual(dict(calls), {}, where)
                err = max((d.full_tensor() - r).abs().max().item() for d, r in zip(dt, ref))
                self.assertLessEqual(err, TOL, f"{where}: max abs error {err}")

    @with_comms
    def test_flattened_and_2d_mesh_reach_the_handler(self):
        # The layout of PyTorch's own test_admaw_fused_across_meshes (which torch 2.13 passes
        # alone): an MLP's first layer Shard(0) on the flattened 1-D mesh of a (2, 2) mesh, its
        # second [Replicate, Shard(0)] on the 2-D mesh. With dtensor_moe each fused step goes
        # through the handler, and matches AdamW on the full tensors.
        from torch.distributed.device_mesh import init_device_mesh

        mesh2d = init_device_mesh(self.device_type, (2, 2), mesh_dim_names=("x", "y"))
        flat = mesh2d["x", "y"]._flatten(mesh_dim_name="xy")
        layout = [((16, 10), flat, [Shard(0)]), ((16,), flat, [Shard(0)]),
                  ((5, 16), mesh2d, [Replicate(), Shard(0)]),
                  ((5,), mesh2d, [Replicate(), Shard(0)])]
        for kwargs in ({"lr": 0.1, "weight_decay": 0.05},
                       {"lr": torch.tensor(0.1), "amsgrad": True, "maximize": True}):
            gen = torch.Generator().manual_seed(0)
            full = [torch.randn(shape, generator=gen) for shape, _, _ in layout]
            ref = [t.clone().requires_grad_() for t in full]
            dt = [distribute_tensor(t, mesh, pl).requires_grad_() for t, (_, mesh, pl)
                  in zip(full, layout)]
            opt_ref = torch.optim.AdamW(ref, fused=True, **kwargs)
            opt_dt = torch.optim.AdamW(dt, fused=True, **{k: v.clone() if isinstance(
                v, torch.Tensor) else v for k, v in kwargs.items()})
            with handler_calls() as calls:
                for _ in range(2):
                    grads = [torch.randn(shape, generator=gen) for shape, _, _ in layout]
                    for r, d, g, (_, mesh, pl) in zip(ref, dt, grads, layout):
                        r.grad, d.grad = g, distribute_tensor(g, mesh, pl)
                    opt_ref.step()
                    opt_dt.step()
            self.assertEqual(sum(calls.values()), 2, kwargs)
            err = max((d.full_tensor() - r).abs().max().item() for d, r in zip(dt, ref))
            self.assertLessEqual(err, TOL, kwargs)

    @with_comms
    def test_fused_step_issues_no_collective(self):
        meshes = build_meshes(self.device_type)
        counts = {}
        for label, cls_name, kwargs in OPTIM_CASES:
            params = [p.requires_grad_() for p in distribute(full_params(), meshes)]
            opt = make_optimizer(cls_name, params, kwargs, "fused")
            for step in range(2):  # the first step creates state, the second reuses it
                for p, g in zip(params, distribute(full_grads(step), meshes)):
                    p.grad = g
                with CommDebugMode() as mode:
                    opt.step()
                counts[f"{label}/step{step}"] = mode.get_total_counts()
        self.assertEqual(set(counts.values()), {0}, counts)
        self.assertExpectedInline(str(sum(counts.values())), """0""")

    @with_comms
    def test_mismatched_placement_is_redistributed_on_its_own_mesh(self):
        meshes = build_meshes(self.device_type)
        ref = [p.requires_grad_() for p in full_params()]
        dt = [p.requires_grad_() for p in distribute(full_params(), meshes)]
        opt_ref = torch.optim.AdamW(ref, lr=0.01, fused=True)
        opt_dt = torch.optim.AdamW(dt, lr=0.01, fused=True)
        for step in range(STEPS):
            grads = full_grads(step)
            for p, g in zip(ref, grads):
                p.grad = g.clone()
            dgrads = distribute(grads, meshes)
            # slot 0 (Shard(0) on the world mesh): a Partial grad -> reduce-scatter on world.
            dgrads[0] = partial_grad(grads[0], meshes["world"], self.rank, self.world_size)
            # slot 3 (Shard(0) on the tp mesh): a Replicate grad -> a local chunk, no comm.
            dgrads[3] = distribute_tensor(grads[3], meshes["tp"], [Replicate()])
            for p, g in zip(dt, dgrads):
                p.grad = g
            if step == 1:
                # an optimizer state with other placements on its own mesh (2-D slot 5)
                state = opt_dt.state[dt[5]]
                state["exp_avg"] = state["exp_avg"].redistribute(
                    meshes["2d"], [Shard(1), Replicate()]
                )
            if step == 2:
                # the same DTensor object changes layout in place (as FSDP2 may swap internals):
                # the handler must see the new spec
                from dtensor_moe import _compat

                sq = opt_dt.state[dt[0]]["exp_avg_sq"]
                _compat.replace_dtensor_storage(
                    sq, sq.redistribute(meshes["world"], [Replicate()])
                )
            opt_ref.step()
            with CommDebugMode() as mode:
                opt_dt.step()
            if step == 2:
                self.assertEqual(
                    opt_dt.state[dt[0]]["exp_avg_sq"].placements, (Replicate(),)
                )
            if step == 1:
                self.assertExpectedInline(
                    str(_comm_counts(mode)),
                    """{'c10d_functional.all_gather_into_tensor': 4, 'c10d_functional.reduce_scatter_tensor': 1}""",  # noqa: B950
                )
        # the state keeps the placements the user gave it
        self.assertEqual(opt_dt.state[dt[5]]["exp_avg"].placements, (Shard(1), Replicate()))
        for d, r in zip(dt, ref):
            self.assertLessEqual((d.full_tensor() - r).abs().max().item(), TOL)
        exp_avg = opt_dt.state[dt[5]]["exp_avg"].full_tensor()
        self.assertLessEqual((exp_avg - opt_ref.state[ref[5]]["exp_avg"]).abs().max().item(), TOL)

    @with_comms
    def test_cross_mesh_slot_raises_on_every_rank(self):
        meshes = build_meshes(self.device_type)
        params = [p.requires_grad_() for p in distribute(full_params(), meshes)]
        grads = distribute(full_grads(0), meshes)
        # slot 4 lives on the tp sub-mesh; give it a grad on the world mesh instead
        grads[4] = distribute_tensor(full_grads(0)[4], meshes["world"], [Replicate()])
        # slot 0 needs a reduce-scatter, which must not start before the error is found
        grads[0] = partial_grad(full_grads(0)[0], meshes["world"], self.rank, self.world_size)
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.Adam(params, lr=0.01, fused=True)
        with CommDebugMode() as mode, self.assertRaisesRegex(
            ValueError,
            r"slot 4 of 'grads' does not follow param 4: it is on a different device mesh.*"
            r"param 4 is a DTensor on DeviceMesh\(.*tp.*'grads'\[4\] is a DTensor on "
            r"DeviceMesh\(.*world",
        ):
            opt.step()
        self.assertEqual(mode.get_total_counts(), 0)
        # every rank raised before any collective: a barrier completes, nothing hangs
        dist.barrier()

    @with_comms
    def test_list_length_and_plain_tensor_errors(self):
        meshes = build_meshes(self.device_type)
        params = distribute(full_params(), meshes)
        grads = distribute(full_grads(0), meshes)
        steps = [torch.tensor(1.0) for _ in params]
        zeros = [torch.zeros_like(p) for p in params]
        kw = dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)
        with self.assertRaisesRegex(ValueError, r"'state_sums' has 6 tensors but 'self' has 7"):
            torch._fused_adagrad_(params, grads, zeros[:6], steps, **kw)
        plain_grads = list(grads)
        plain_grads[2] = full_grads(0)[2]
        with self.assertRaisesRegex(ValueError, r"slot 2 of 'grads'.*mixes DTensor and torch"):
            torch._fused_adagrad_(params, plain_grads, zeros, steps, **kw)
        shard_lr = distribute_tensor(torch.ones(4), meshes["world"], [Shard(0)])
        with self.assertRaisesRegex(ValueError, r"global scalar 'lr' is a DTensor"):
            torch._fused_adagrad_(params, grads, zeros, steps, **{**kw, "lr": shard_lr})


class GradScalerAcrossMeshesTest(DistTestBase):
    def _scaled_step(self, meshes, inf_rank: int | None):
        """One GradScaler step of fused Adam; returns (stepped?, new scale) seen on this rank."""
        # the first grad sits on the tp sub-mesh: torch reduces found_inf over that group only
        layout = [("tp", (6, 2), [Shard(0)]), ("world", (8, 2), [Shard(0)]),
                  ("2d", (4, 4), [Shard(0), Shard(1)])]
        gen = torch.Generator().manual_seed(0)
        params = [
            distribute_tensor(torch.randn(shape, generator=gen), meshes[key], pl).requires_grad_()
            for key, shape, pl in layout
        ]
        before = [p.detach().to_local().clone() for p in params]
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        opt = torch.optim.Adam(params, lr=0.1, fused=True)
        scaler.scale(torch.ones(()))  # initializes the scale, as scaler.scale(loss) would
        for p in params:
            p.grad = torch.ones_like(p) * 4.0
        if inf_rank is not None and self.rank == inf_rank:
            p0 = params[0].grad.to_local()
            p0[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        # did this rank step its own shards?
        stepped = any(not torch.equal(p.detach().to_local(), b) for p, b in zip(params, before))
        return stepped, scaler.get_scale()

    def _gather(self, value):
        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    @with_comms
    def test_one_decision_on_every_rank(self):
        meshes = build_meshes(self.device_type)
        decisions = self._gather(self._scaled_step(meshes, inf_rank=3))
        self.assertEqual(decisions, [(False, 2.0)] * 4)
        decisions = self._gather(self._scaled_step(meshes, inf_rank=None))
        self.assertEqual(decisions, [(True, 4.0)] * 4)

    @with_comms
    def test_torch_handler_alone_disagrees(self):
        """Keeps the reason for our handler: torch 2.13 reduces over the first grad's mesh."""
        from dtensor_moe import _compat
        from dtensor_moe.optim.scaler import found_inf_handler

        meshes = build_meshes(self.device_type)
        op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
        handlers = _compat.custom_op_handlers()
        from torch.distributed.tensor._dispatch import found_inf_reduce_handler

        handlers[op] = found_inf_reduce_handler
        try:
            decisions = self._gather(self._scaled_step(meshes, inf_rank=3))
        finally:
            handlers[op] = found_inf_handler
        # ranks 0 and 1 (the other tp group) never see the inf and step; 2 and 3 skip
        self.assertEqual(decisions, [(True, 4.0), (True, 4.0), (False, 2.0), (False, 2.0)])


class OutOfPlaceAndOutOverloadsTest(DistTestBase):
    def _lists(self, meshes, packet: str):
        n_state = {"adam": 3, "adamw": 3, "sgd": 1, "adagrad": 1}[packet]
        full = {
            "self": full_params(),
            "grads": full_grads(0),
            "state": [[t.abs() for t in full_grads(10 + k)] for k in range(n_state)],
        }
        steps = [torch.tensor(2.0) for _ in full["self"]]
        return full, steps

    def _kwargs(self, packet: str, tensor_lr: bool):
        lr = torch.tensor(0.05) if tensor_lr else 0.05
        if packet in ("adam", "adamw"):
            return dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8,
                        amsgrad=True, maximize=False)
        if packet == "sgd":
            return dict(weight_decay=0.01, momentum=0.9, lr=lr, dampening=0.0,
                        nesterov=False, maximize=False, is_first_step=False)
        return dict(lr=lr, lr_decay=0.01, weight_decay=0.01, eps=1e-10, maximize=False)

    def _call(self, packet, overload, lists, steps, kwargs, out):
        op = getattr(getattr(torch.ops.aten, f"_fused_{packet}"), overload)
        args = [lists["self"], lists["grads"], *lists["state"]]
        if packet != "sgd":
            args.append(steps)
        if out is not None:
            kwargs = {**kwargs, "out": out}
        return op(*args, **kwargs)

    @with_comms
    def test_out_of_place_and_out_match_full_tensors(self):
        meshes = build_meshes(self.device_type)
        checked = []
        for packet in ("adam", "adamw", "sgd", "adagrad"):
            for overload in ("default", "tensor_lr", "out", "tensor_lr_out"):
                tensor_lr = overload.startswith("tensor_lr")
                full, steps = self._lists(meshes, packet)
                dt = {"self": distribute(full["self"], meshes),
                      "grads": distribute(full["grads"], meshes),
                      "state": [distribute(s, meshes) for s in full["state"]]}
                is_out = overload.endswith("out")
                out_full = [torch.empty_like(p) for p in full["self"]] if is_out else None
                out_dt = [torch.empty_like(p) for p in dt["self"]] if is_out else None
                kwargs = self._kwargs(packet, tensor_lr)
                with CommDebugMode() as mode:
                    res_dt = self._call(packet, overload, dt, steps, kwargs, out_dt)
                self.assertEqual(mode.get_total_counts(), 0)
                res_full = self._call(packet, overload, full, steps, kwargs, out_full)
                if is_out:
                    res_dt, res_full = [out_dt], [out_full]
                for got_list, want_list in zip(res_dt, res_full):
                    for got, want in zip(got_list, want_list):
                        # tensors follow their input: DTensor slots stay DTensors, torch.optim's
                        # plain 0-dim state_steps stay plain
                        self.assertEqual(isinstance(got, DTensor), want.dim() > 0)
                        got = got.full_tensor() if isinstance(got, DTensor) else got
                        err = (got - want).abs().max().item()
                        self.assertLessEqual(err, TOL, f"{packet}.{overload}")
                # the params the out-of-place overloads were given are left untouched
                for p, f in zip(dt["self"], full_params()):
                    self.assertEqual(p.full_tensor(), f)
                checked.append(f"{packet}.{overload}")
        self.assertEqual(len(checked), 16)

    @with_comms
    def test_in_place_overloads_through_dtensor_dispatch(self):
        """torch.ops.aten._fused_*_ goes through DTensor dispatch, not the torch._fused_*_ entry."""
        meshes = build_meshes(self.device_type)
        for packet in ("adam", "adamw", "sgd", "adagrad"):
            for overload in ("default", "tensor_lr"):
                full, steps = self._lists(meshes, packet)
                dt = {"self": distribute(full["self"], meshes),
                      "grads": distribute(full["grads"], meshes),
                      "state": [distribute(s, meshes) for s in full["state"]]}
                kwargs = self._kwargs(packet, overload == "tensor_lr")
                op = getattr(getattr(torch.ops.aten, f"_fused_{packet}_"), overload)
                for lists in (dt, full):
                    args = [lists["self"], lists["grads"], *lists["state"]]
                    with CommDebugMode() as mode:
                        op(*(args + ([steps] if packet != "sgd" else [])), **kwargs)
                    self.assertEqual(mode.get_total_counts(), 0)
                for name in ("self", "grads"):
                    for got, want in zip(dt[name], full[name]):
                        self.assertLessEqual((got.full_tensor() - want).abs().max().item(), TOL)
                for got_list, want_list in zip(dt["state"], full["state"]):
                    for got, want in zip(got_list, want_list):
                        self.assertLessEqual((got.full_tensor() - want).abs().max().item(), TOL)


if __name__ == "__main__":
    run_tests()
