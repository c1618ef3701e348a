"""The parallel MoE styles beyond parity (4 gloo ranks): collective counts, early errors,
re-entrancy (activation checkpointing, two forwards before a backward) and zero-token ranks.

Shape legend: B sequences, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy

from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms
from torch.utils.checkpoint import checkpoint

from dtensor_moe import (
    ExpertParallel,
    ExpertTensorParallel,
    MoE,
    MoEConfig,
    PrepareMoEInput,
    build_moe_meshes,
    parallelize_moe,
)
import dtensor_moe.routed.all_to_all as dispatch_module
from dtensor_moe.routed import AllToAllExchange, LocalExchange, permute_tokens
from tests._dist import DistTestBase
from tests.test_moe_layer import reference_moe
from tests.test_parallel_moe import (
    LAYOUTS,
    Case,
    D,
    E,
    H,
    as_param_grad,
    close,
    full,
    make_config,
    reduce_grad,
)

COUNT_CASE = Case(B=2, L=7, top_k=2, shared=1)


def _counts(mode: CommDebugMode) -> str:
    counts = sorted((str(op).split(".")[-1], n) for op, n in mode.get_comm_counts().items())
    return " ".join(f"{op}={n}" for op, n in counts) or "none"


def _build(name: str, case: Case, overlap: bool = True, **config):
    layout = LAYOUTS[name]
    meshes = build_moe_meshes(**layout.meshes)
    torch.manual_seed(0)
    model = MoE(make_config(case, **config))
    parallelize_moe(
        model,
        meshes,
        sequence_parallel=layout.sequence_parallel,
        expert_tp_dispatch=layout.expert_tp_dispatch,
        ep_overlap=overlap,
    )
    return model, meshes, layout


def _input(meshes, layout, x_BLD: torch.Tensor) -> torch.Tensor:
    """This rank's MoE input: a DTensor on the tp mesh, or a plain tensor without tp."""
    x_BLD = x_BLD.clone()
    if meshes.tp == 1:
        return x_BLD.requires_grad_()
    placement = Shard(1) if layout.sequence_parallel else Replicate()
    return distribute_tensor(x_BLD, meshes.dense["tp"], [placement]).requires_grad_()


def _local_loss(y: torch.Tensor) -> torch.Tensor:
    y_local = y.to_local() if isinstance(y, DTensor) else y
    return (y_local * torch.linspace(-1, 1, y_local.numel()).view_as(y_local)).sum()


class ParallelStylesTest(DistTestBase):
    @with_comms
    def test_collective_counts_per_layout(self):
        """Forward and backward collectives of one training step, per layout (B=2, L=7, top-2,
        one shared expert, aux loss on: the forward all_reduce of "split" routing is the
        per-sequence router statistics). A stray all-gather shows up as a diff here. Counted
        on the second step: the first adds the one-time all_gather of Note [Ranks with
        identical tokens] (pinned in tests/test_ep_misuse.py)."""
        lines = []
        for name in LAYOUTS:
            model, meshes, layout = _build(name, COUNT_CASE)
            torch.manual_seed(1 + self.rank // meshes.tp)
            x = _input(meshes, layout, torch.randn(COUNT_CASE.B, COUNT_CASE.L, D))
            _local_loss(model(x)).backward()
            with CommDebugMode() as fwd:
                y = model(x)
            with CommDebugMode() as bwd:
                _local_loss(y).backward()
            lines.append(f"{name}: forward {_counts(fwd)} | backward {_counts(bwd)}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
ep2: forward alltoall_base_=3 | backward alltoall_base_=2
ep4: forward alltoall_base_=3 | backward alltoall_base_=2
etp2: forward all_reduce=1 alltoall_base_=3 | backward alltoall_base_=2
etp2_gather: forward all_reduce=1 | backward all_reduce=1
ep2tp2: forward all_reduce=1 alltoall_base_=3 | backward alltoall_base_=2
ep2tp2_gather: forward all_gather_into_tensor=1 alltoall_base_=3 reduce_scatter_tensor=1 | backward all_gather_into_tensor=1 alltoall_base_=2 reduce_scatter_tensor=1
sp2ep2: forward all_reduce=1 alltoall_base_=3 | backward alltoall_base_=2
tp2ep2: forward all_gather_into_tensor=1 all_reduce=1 alltoall_base_=3 | backward all_gather_into_tensor=1 alltoall_base_=2
sp2ep4: forward all_reduce=1 alltoall_base_=3 | backward alltoall_base_=2""",
        )

    @with_comms
    def test_overlap_switch_picks_the_path(self):
        """``overlap`` (ExpertParallel / ExpertTensorParallel / parallelize_moe's ep_overlap)
        is the one switch between computing the own rows during the output exchange (Note [Own
        rows]) and sending every row; both give the same output (the parity matrix of
        test_parallel_moe.py runs both). The send sizes show which: with overlap, a rank sends
        none of its rows to itself."""
        outputs, nodes = {}, {}
        for overlap in (True, False):
            model, meshes, layout = _build("ep2tp2", COUNT_CASE, overlap=overlap)
            self.assertIs(model.experts.exchange.overlap, overlap)
            self.assertIn(f"overlap={overlap}", repr(model.experts.exchange))
            torch.manual_seed(1 + self.rank // meshes.tp)
            x = _input(meshes, layout, torch.randn(COUNT_CASE.B, COUNT_CASE.L, D))
            seen = []
            real = dispatch_module.Exchange

            def recording(group, send, recv, *args, real=real, seen=seen, **kwargs):
                seen.append(send[dist.get_rank(group)])
                return real(group, send, recv, *args, **kwargs)

            with mock.patch.object(dispatch_module, "Exchange", recording):
                y = model(x)
            nodes[overlap] = all(n == 0 for n in seen)
            outputs[overlap] = y.to_local().detach()
        self.assertEqual(nodes, {True: True, False: False})
        torch.testing.assert_close(outputs[False], outputs[True], rtol=1e-5, atol=1e-6)
        for bad in ("yes", 1):
            with self.assertRaisesRegex(TypeError, "overlap must be a bool"):
                ExpertParallel(overlap=bad)
            with self.assertRaisesRegex(TypeError, "overlap must be a bool"):
                ExpertTensorParallel(overlap=bad)

    @with_comms
    def test_exchanges_are_autograd_pairs_and_run_under_no_grad(self):
        """The default EP path's exchanges are start/wait autograd pairs (Note [Exchanges as
        autograd pairs]); under ``no_grad`` it gives the same output; an expanded upstream
        gradient (zero strides, from ``.sum()``) is accepted (Note [grouped_mm expanded grad])."""
        model, meshes, layout = _build("ep4", COUNT_CASE)
        torch.manual_seed(1 + self.rank)
        x = _input(meshes, layout, torch.randn(COUNT_CASE.B, COUNT_CASE.L, D))
        y = model(x)
        names, seen, stack = set(), set(), [y.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                names.add(type(fn).__name__)
                stack.extend(f for f, _ in fn.next_functions)
        for node in ("_ScatterStart", "_ScatterWait", "_GatherStart", "_GatherWait"):
            self.assertIn(f"{node}Backward", names)
        with torch.no_grad():
            y_inference = model(x)
        self.assertEqual(y_inference, y.detach(), atol=0, rtol=0)
        (grad_sum,) = torch.autograd.grad(model(x).sum(), x)
        (grad_ones,) = torch.autograd.grad(model(x), x, torch.ones(x.shape))
        self.assertEqual(grad_sum, grad_ones, atol=0, rtol=0)

    @with_comms
    def test_double_backward_through_the_exchanges(self):
        """Note [Double backward] in dtensor_moe/routed/layouts.py: under EP4, on the default
        path and with the plain one (overlap=False, fused_routed_step=False), a gradient
        penalty's gradients equal those of the per-token reference (plain autograd, not the
        layer): the first-order input gradient, the input's and every parameter's gradient."""
        for overlap in (True, False):
            self._double_backward_ep4(overlap)

    def _double_backward_ep4(self, overlap):
        config = dict(aux_loss_coeff=0.0, use_expert_bias=False, fused_routed_step=overlap)
        model, meshes, _ = _build("ep4", COUNT_CASE, overlap=overlap, **config)
        torch.manual_seed(0)
        ref = MoE(make_config(COUNT_CASE, **config))
        B, L = COUNT_CASE.B, COUNT_CASE.L
        X = torch.randn(4 * B, L, D, generator=torch.Generator().manual_seed(5))
        W = torch.randn(4 * B, L, D, generator=torch.Generator().manual_seed(6))
        mine = slice(B * self.rank, B * (self.rank + 1))

        def penalty(layer, x, w):
            (g,) = torch.autograd.grad((layer(x) * w).sum(), x, create_graph=True)
            g.pow(2).sum().backward()
            return g.detach()

        x = X[mine].clone().requires_grad_()
        g = penalty(model, x, W[mine])
        x_ref = X.clone().requires_grad_()
        g_ref = penalty(lambda x: reference_moe(ref, x)[0], x_ref, W)
        close(g, g_ref[mine], "first-order input gradient")
        close(x.grad, x_ref.grad[mine], "x.grad")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            local = reduce_grad(name, param, meshes) * meshes.dp  # the sum over ranks
            close(full(as_param_grad(param, local)), ref_params[name].grad, f"{name}.grad")

    @with_comms
    def test_double_backward_under_sequence_parallelism(self):
        """The same under SP2 x EP2 (uneven L = 7 over the tp ranks, the plain exchange): the
        input is a DTensor whose gradient leaves through ``local_views``, whose backward keeps
        the graph in grad mode (Note [Double backward] in dtensor_moe/routed/layouts.py)."""
        config = dict(aux_loss_coeff=0.0, use_expert_bias=False, fused_routed_step=False)
        model, meshes, layout = _build("sp2ep2", COUNT_CASE, overlap=False, **config)
        torch.manual_seed(0)
        ref = MoE(make_config(COUNT_CASE, **config))
        B, L, dp = COUNT_CASE.B, COUNT_CASE.L, meshes.dp
        X = torch.randn(dp * B, L, D, generator=torch.Generator().manual_seed(5))
        W = torch.randn(dp * B, L, D, generator=torch.Generator().manual_seed(6))
        mine = slice(B * (self.rank // meshes.tp), B * (self.rank // meshes.tp + 1))
        tp_mesh = meshes.dense["tp"]
        x = _input(meshes, layout, X[mine])
        w = distribute_tensor(W[mine], tp_mesh, [Shard(1)]).to_local()
        (g,) = torch.autograd.grad((model(x).to_local() * w).sum(), x, create_graph=True)
        g.to_local().pow(2).sum().backward()
        x_ref = X.clone().requires_grad_()
        (g_ref,) = torch.autograd.grad(
            (reference_moe(ref, x_ref)[0] * W).sum(), x_ref, create_graph=True
        )
        g_ref.pow(2).sum().backward()
        close(g.full_tensor(), g_ref[mine].detach(), "first-order input gradient")
        close(x.grad.full_tensor(), x_ref.grad[mine], "x.grad")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            local = reduce_grad(name, param, meshes) * dp  # the sum over data shards
            close(full(as_param_grad(param, local)), ref_params[name].grad, f"{name}.grad")

    @with_comms
    def test_errors_before_any_collective(self):
        cfg = MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=2)
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
        cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
        tp = grid["etp"]
        cases = [
            (
                "num_experts % ep",
                lambda: parallelize_module(
                    MoE(MoEConfig(dim=D, hidden_dim=H, num_experts=6, top_k=2)).experts,
                    world,
                    ExpertParallel(),
                ),
                r"num_experts=6 is not divisible by the expert-parallel degree ep=4",
            ),
            (
                "ExpertParallel on a 2-D mesh",
                lambda: parallelize_module(MoE(cfg).experts, grid, ExpertParallel()),
                r"ExpertParallel needs a 1-D DeviceMesh, got a 2-D mesh",
            ),
            (
                "ExpertTensorParallel on a 3-D mesh",
                lambda: parallelize_module(MoE(cfg).experts, cube, ExpertTensorParallel()),
                r"ExpertTensorParallel\(dispatch='all_to_all', overlap=True\) needs a 1-D or 2-D DeviceMesh, got a 3-D mesh",
            ),
            (
                "PrepareMoEInput on a 2-D mesh",
                lambda: parallelize_module(MoE(cfg), grid, PrepareMoEInput()),
                r"PrepareMoEInput\(.*\) needs a 1-D DeviceMesh, got a 2-D mesh",
            ),
            (
                "hidden_dim % etp",
                lambda: parallelize_module(
                    MoE(MoEConfig(dim=D, hidden_dim=15, num_experts=E, top_k=2)).experts,
                    grid,
                    ExpertTensorParallel(),
                ),
                r"hidden_dim=15 is not divisible by the expert tensor-parallel degree etp=2",
            ),
            (
                "MoE config differs across ranks",
                lambda: parallelize_module(
                    MoE(MoEConfig(dim=D, hidden_dim=H, num_experts=E, top_k=1 + self.rank % 2)),
                    tp,
                    PrepareMoEInput(),
                ),
                r"the MoE config differs across the ranks of .*top_k=1.*top_k=2",
            ),
            (
                "experts config differs across ranks",
                lambda: parallelize_module(
                    MoE(
                        MoEConfig(dim=D, hidden_dim=16 * (1 + self.rank), num_experts=E, top_k=2)
                    ).experts,
                    world,
                    ExpertParallel(),
                ),
                r"the experts' configuration differs across the ranks",
            ),
            (
                "one rank's divisibility error reaches every rank",
                lambda: parallelize_module(
                    MoE(
                        MoEConfig(dim=D, hidden_dim=H, num_experts=6 if self.rank else 8, top_k=2)
                    ).experts,
                    world,
                    ExpertParallel(),
                ),
                r"num_experts=6 is not divisible by the expert-parallel degree ep=4",
            ),
            (
                "style on the wrong module",
                lambda: parallelize_module(MoE(cfg).router, world, ExpertParallel()),
                r"ExpertParallel applies to a GroupedExperts .*got TokenChoiceTopKRouter",
            ),
            (
                "unknown input layout",
                lambda: PrepareMoEInput(input_layout=Shard(2)),
                r"input_layout must be Shard\(1\) \(sequence parallel\) or Replicate\(\), got Shard\(dim=2\)",
            ),
            (
                "unknown routing",
                lambda: PrepareMoEInput(routing="gather"),
                r"routing must be 'split' .* or 'replicate' .* got 'gather'",
            ),
            (
                "parallelize_moe without an MoE",
                lambda: parallelize_moe(
                    torch.nn.Linear(2, 2), build_moe_meshes(dp=4, ep=4), sequence_parallel=False
                ),
                r"parallelize_moe found no MoE layer in Linear",
            ),
        ]
        for what, fn, pattern in cases:
            with self.assertRaisesRegex((ValueError, TypeError), pattern, msg=what):
                fn()
        self._forward_errors(cfg)
        dist.barrier()  # every rank raised at the same point: the group is still in step

    def _forward_errors(self, cfg: MoEConfig) -> None:
        meshes = build_moe_meshes(dp=2, ep=2, tp=2)
        tp = meshes.dense["tp"]
        sp_moe = parallelize_moe(MoE(cfg), meshes, sequence_parallel=True)
        x = torch.randn(2, 5, D)
        x_rep, x_s0, x_s1 = (
            distribute_tensor(x, tp, [p]) for p in (Replicate(), Shard(0), Shard(1))
        )
        split_etp, replicate_ep = (
            _mismatched_routing(cfg, meshes, r) for r in ("split", "replicate")
        )
        cases = [
            (
                "Replicate input to a Shard(1) plan",
                lambda: sp_moe(x_rep),
                (
                    r"expects the MoE input on .* with placements \(Shard\(dim=1\),\), got .*"
                    r"\(Replicate\(\),\)"
                ),
            ),
            (
                "Shard(0) input",
                lambda: sp_moe(x_s0),
                r"with placements \(Shard\(dim=1\),\), got .*\(Shard\(dim=0\),\)",
            ),
            (
                "plain tensor to a Shard(1) plan",
                lambda: sp_moe(x),
                (
                    r"input_layout=Shard\(1\)\) got a plain tensor; pass the sequence-parallel "
                    r"activation as a DTensor"
                ),
            ),
            (
                "split routing with gathering expert-TP experts",
                lambda: split_etp(x_s1),
                (
                    r"routing='split'\) routes different tokens .* ExpertParallel over an EP "
                    r"mesh .*\(dispatch='gather'\) needs routing='replicate'"
                ),
            ),
            (
                "replicate routing with EP experts",
                lambda: replicate_ep(x_s1),
                r"routing='replicate'\) needs the experts sharded with ExpertTensorParallel",
            ),
            (
                "applying PrepareMoEInput twice",
                lambda: parallelize_module(sp_moe, tp, PrepareMoEInput()),
                r"this MoE already has a token-parallel plan",
            ),
            (
                "a Shard(1) input whose shards are not DTensor's split (from_local with shape)",
                lambda: sp_moe(_misplit_sequence_shards(x, tp)),
                (
                    r"PrepareMoEInput: the Shard\(1\) input of global shape \(2, 5, 16\) holds a "
                    r"local shard of shape \(2, [23], 16\) on tp rank [01], but DTensor's split "
                    r"of L=5 over tp=2 gives it \(2, [23], 16\) \(lengths \[3, 2\]\); build the "
                    r"input with distribute_tensor or redistribute"
                ),
            ),
        ]
        for what, fn, pattern in cases:
            with CommDebugMode() as comm, self.assertRaisesRegex(ValueError, pattern, msg=what):
                fn()
            self.assertEqual(comm.get_total_counts(), 0, f"{what}: a collective ran")
        # combine with metadata from another exchange: TypeError before the exchange
        x_TD = torch.randn(3, D)
        ids_TK = torch.tensor([[0, 1], [2, 3], [4, 5]])
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
        plain = LocalExchange(num_experts=E).dispatch(x_TD, torch.ones(3, 2), ids_TK, counts_E)
        routed_RD = permute_tokens(x_TD, plain.layout)
        ep_exchange = AllToAllExchange(num_experts=E, mesh=meshes.expert["ep"])
        with CommDebugMode() as comm, self.assertRaisesRegex(
            TypeError,
            r"AllToAllExchange.combine needs the Routed that this exchange's dispatch "
            r"returned \(it carries the exchange\), got one without an exchange",
        ):
            ep_exchange.combine(routed_RD, plain)
        self.assertEqual(comm.get_total_counts(), 0, "combine: a collective ran")

    @with_comms
    def test_checkpoint_and_two_forwards_before_backward(self):
        """No per-forward state: two micro-batches run one after the other, recomputed under
        torch.utils.checkpoint, or both in flight before one backward, each give the
        single-device layer's outputs, input grads, param grads (reduced as documented) and
        router counters, at 1e-5 (fp32)."""
        case = Case(B=2, L=7, top_k=2, shared=1)
        for name in ("sp2ep2", "tp2ep2", "ep2tp2", "ep4"):
            base, meshes, layout = _build(name, case)
            torch.manual_seed(0)
            ref = MoE(make_config(case))  # the weights _build parallelized
            gen = torch.Generator().manual_seed(1)
            shape = (meshes.dp * case.B, case.L, D)  # the global batch: dp shards of B sequences
            batches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
                       for _ in range(2)]
            dp_i = self.rank // meshes.tp
            shard = slice(dp_i * case.B, (dp_i + 1) * case.B)
            expected = []
            for X, G in batches:
                x_ref = X.clone().requires_grad_()
                y_ref = ref(x_ref)
                (y_ref * G).sum().div(meshes.dp).backward()
                expected.append((y_ref.detach()[shard], x_ref.grad[shard]))
            for mode in ("plain", "ckpt", "in flight"):
                model = copy.deepcopy(base)
                ys, xs = _micro_batches(model, mode, meshes, layout, batches, shard)
                for i, (y, x) in enumerate(zip(ys, xs)):
                    close(full(y), expected[i][0], f"{name} {mode}: output {i}")
                    close(full(x.grad) / meshes.dp, expected[i][1], f"{name} {mode}: x.grad {i}")
                ref_params = dict(ref.named_parameters())
                for n, p in model.named_parameters():
                    grad = as_param_grad(p, reduce_grad(n, p, meshes))
                    close(full(grad), ref_params[n].grad, f"{name} {mode}: {n}.grad")
                counts = model.router.tokens_per_expert.clone()
                dist.all_reduce(counts)  # every token is counted on one rank of the world
                self.assertEqual(
                    counts.tolist(), ref.router.tokens_per_expert.tolist(),
                    f"{name} {mode}: router counter",
                )

    @with_comms
    def test_zero_tokens_on_a_rank_and_on_experts(self):
        """dp2ep: ranks route 5, 3, 1 and 0 tokens, and the expert bias sends every token to
        experts 0 and 1 (both on rank 0), so ranks 1 to 3 receive zero rows. Same results as the
        single-device layer on each rank's tokens; every collective agrees on its sizes."""
        cfg = make_config(Case(B=1, L=1, top_k=2, shared=1), aux_loss_coeff=0.0)
        meshes = build_moe_meshes(dp=4, ep=4)
        torch.manual_seed(0)
        ref = MoE(cfg)
        ref.router.expert_bias.copy_(torch.tensor([100.0, 100.0] + [0.0] * (E - 2)))
        model = parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False)
        lengths = (5, 3, 1, 0)
        xs = [torch.randn(1, n, D, generator=torch.Generator().manual_seed(n)) for n in lengths]
        for x in xs:
            _local_loss(ref(x)).backward()
        x = xs[self.rank].clone().requires_grad_()
        y = model(x)
        _local_loss(y).backward()
        x_ref = xs[self.rank].clone().requires_grad_()
        close(y, copy.deepcopy(ref)(x_ref), "output")
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = full(p.grad).clone()
            if not isinstance(p, DTensor):
                dist.all_reduce(grad)
            close(grad, ref_params[name].grad, f"{name}.grad")
        counts = model.router.tokens_per_expert.clone()
        dist.all_reduce(counts)
        self.assertEqual(counts.tolist(), [sum(lengths), sum(lengths)] + [0] * (E - 2))


def _micro_batches(model, mode, meshes, layout, batches, shard):
    """Forward and backward of two micro-batches (this rank's part of each global ``(X, G)``):
    ``"plain"`` one after the other, ``"ckpt"`` the same under ``torch.utils.checkpoint``,
    ``"in flight"`` both forwards before one backward. Returns the outputs and the inputs."""
    inputs, weights = [], []
    for X, G in batches:
        if meshes.tp == 1:
            inputs.append(X[shard].clone().requires_grad_())
            weights.append(G[shard])
            continue
        placement = [Shard(1) if layout.sequence_parallel else Replicate()]
        tp_mesh = meshes.dense["tp"]
        inputs.append(distribute_tensor(X[shard], tp_mesh, placement).requires_grad_())
        weights.append(distribute_tensor(G[shard], tp_mesh, placement).to_local())

    def loss(y, g):
        return ((y.to_local() if isinstance(y, DTensor) else y) * g).sum()

    if mode == "in flight":
        ys = [model(x) for x in inputs]
        sum(loss(y, g) for y, g in zip(ys, weights)).backward()
        return ys, inputs
    ys = []
    for x, g in zip(inputs, weights):
        y = checkpoint(model, x, use_reentrant=False) if mode == "ckpt" else model(x)
        loss(y, g).backward()
        ys.append(y)
    return ys, inputs


def _misplit_sequence_shards(x_BLD: torch.Tensor, tp_mesh) -> DTensor:
    """A ``Shard(1)`` DTensor of ``x_BLD`` (L=5 over 2 ranks) whose shards hold 2 and 3 rows:
    DTensor's split is 3 and 2, and ``from_local`` with an explicit shape does not check."""
    rank = tp_mesh.get_local_rank()
    local = x_BLD[:, :2] if rank == 0 else x_BLD[:, 2:]
    return DTensor.from_local(
        local.contiguous(), tp_mesh, [Shard(1)], shape=x_BLD.shape, stride=x_BLD.stride()
    )


def _mismatched_routing(cfg, meshes, routing):
    """An MoE whose PrepareMoEInput routing does not match its experts' style."""
    moe = MoE(cfg)
    if routing == "split":
        parallelize_module(moe.experts, meshes.dense["tp"], ExpertTensorParallel(dispatch="gather"))
    else:
        parallelize_module(moe.experts, meshes.expert["ep"], ExpertParallel())
    return parallelize_module(moe, meshes.dense["tp"], PrepareMoEInput(routing=routing))



class PlanDictTest(DistTestBase):
    @with_comms
    def test_parallelize_module_with_a_plan_dict(self):
        """``parallelize_module(moe, mesh, {"experts": ExpertParallel()})``, as in the docs,
        gives exactly what ``parallelize_moe`` gives for EP over the data ranks."""
        case = Case(B=2, L=7, top_k=2, shared=1)
        reference, meshes, _ = _build("ep4", case)
        torch.manual_seed(0)
        model = MoE(make_config(case))
        parallelize_module(model, meshes.expert["ep"], {"experts": ExpertParallel()})
        self.assertIsInstance(model.experts.w1, DTensor)
        self.assertEqual(model.experts.w1.placements, (Shard(0),))
        x = torch.randn(case.B, case.L, D, generator=torch.Generator().manual_seed(self.rank))
        outputs = []
        for m in (reference, model):
            x_m = x.clone().requires_grad_()
            y = m(x_m)
            _local_loss(y).backward()
            outputs.append((y.detach(), x_m.grad, {n: p.grad for n, p in m.named_parameters()}))
        (y_ref, gx_ref, grads_ref), (y_got, gx_got, grads_got) = outputs
        self.assertEqual(y_got, y_ref, atol=0, rtol=0)
        self.assertEqual(gx_got, gx_ref, atol=0, rtol=0)
        self.assertEqual(grads_got.keys(), grads_ref.keys())
        for name, grad in grads_got.items():
            self.assertEqual(full(grad), full(grads_ref[name]), atol=0, rtol=0, msg=name)


if __name__ == "__main__":
    run_tests()
