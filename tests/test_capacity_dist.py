"""Expert capacity under the parallel layouts (4 gloo ranks): the same pairs are dropped as on a
single device running the same batch, and outputs and gradients match it (Note [Expert
capacity] in ``dtensor_moe/moe/capacity.py``).

Capacity is per forward batch: a data-parallel rank's micro-batch (EP over data ranks), or the
tp group's batch under sequence or tensor parallelism. So the reference is the single-device
layer run on each data shard separately (not on the concatenated global batch), with the same
weights; the harness of ``tests/test_parallel_moe.py`` does the rest (3 training steps with
fused AdamW and the expert-bias update; output, input gradient, every parameter gradient, the
auxiliary loss and the bias at 1e-5 relative), and the dropped pairs per expert, summed over
ranks, equal the reference's.
"""

# ruff: noqa: N806

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoE
from dtensor_moe.moe.balance import collect_aux_losses
from dtensor_moe.parallel import build_moe_meshes, parallelize_moe
from tests import (
    test_parallel_compile,  # its helpers; not its test class (collected twice)
)
from tests._dist import DistTestBase
from tests.test_parallel_moe import (
    D,
    LAYOUTS,
    Case,
    ParallelRun,
    close,
    make_config,
    run_steps,
)

CAPACITY = dict(capacity_factor=0.5)  # C = ceil(0.5 * B * L * K / E): many drops


class ShardwiseRun(ParallelRun):
    """:class:`ParallelRun` whose reference runs each data shard as its own forward batch."""

    def reference_forward_backward(self, x_ref):
        dp, B = self.meshes.dp, self.case.B
        ys, aux_values = [], []
        with collect_aux_losses() as aux_ref:
            for d in range(dp):
                ys.append(self.ref(x_ref[d * B : (d + 1) * B]))
                aux_values.append(self.ref.router.last_aux_loss)
        y_ref = torch.cat(ys)
        ((y_ref * self.G).sum().div(dp) + aux_ref.total() / dp).backward()
        self.ref.router.last_aux_loss = torch.stack(aux_values).mean()  # what step() compares
        return y_ref

    def forward_backward(self):
        expected = super().forward_backward()
        # this step's dropped pairs per expert (the counters are reset by the bias update)
        dropped = self.model.router.dropped_per_expert.clone()
        dist.all_reduce(dropped)
        ref_dropped = self.ref.router.dropped_per_expert.clone()
        if self.case.B * self.case.L > 1:  # one token never over-fills an expert
            assert ref_dropped.sum() > 0, "the case must drop some pairs"
        expected["dropped pairs per expert"] = (dropped.double(), ref_dropped.double())
        return expected


class RaggedRun(ShardwiseRun):
    """:class:`ShardwiseRun` whose data shards have different lengths, which change from step
    to step (``L + (shard + step) % dp``): with ``capacity_per_expert`` the capacity, and so
    the static exchange's sizes, are the same on every rank for every batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps_done = 0
        self.mine = self.shard.start // self.case.B

    def forward_backward(self):
        dp, B, L = self.meshes.dp, self.case.B, self.case.L
        lengths = [L + (d + self.steps_done) % dp for d in range(dp)]
        self.steps_done += 1
        gen = torch.Generator().manual_seed(self.steps_done)
        xs = [torch.randn(B, n, D, generator=gen) for n in lengths]
        gs = [torch.randn(B, n, D, generator=gen) for n in lengths]
        xs_ref = [x.clone().requires_grad_() for x in xs]
        ys, aux_values = [], []
        with collect_aux_losses() as aux_ref:
            for x_ref in xs_ref:
                ys.append(self.ref(x_ref))
                aux_values.append(self.ref.router.last_aux_loss)
        loss_ref = sum((y * g).sum() for y, g in zip(ys, gs, strict=True)) / dp
        (loss_ref + aux_ref.total() / dp).backward()
        self.ref.router.last_aux_loss = torch.stack(aux_values).mean()
        x = xs[self.mine].clone().requires_grad_()
        with collect_aux_losses() as aux:
            y = self.model(x)
        ((y * gs[self.mine]).sum() + aux.total()).backward()
        dropped = self.model.router.dropped_per_expert.clone()
        dist.all_reduce(dropped)
        ref_dropped = self.ref.router.dropped_per_expert.clone()
        assert ref_dropped.sum() > 0, "the case must drop some pairs"
        return {
            "y": (y.detach(), ys[self.mine].detach()),
            "x.grad": (x.grad / dp, xs_ref[self.mine].grad),
            "dropped pairs per expert": (dropped.double(), ref_dropped.double()),
        }


RUNS = [  # (layout, case, capacity options): every layout kind, both policies, both layouts
    ("ep4", Case(2, 7, 2, 1), dict(drop_policy="probs")),
    ("ep4", Case(2, 7, 2, 0), dict(drop_policy="position", pad_to_capacity=True)),
    ("sp2ep2", Case(2, 7, 2, 1), dict(drop_policy="position")),
    ("sp2ep2", Case(2, 7, 2, 0), dict(drop_policy="probs", pad_to_capacity=True)),
    ("ep2tp2", Case(2, 7, 2, 0), dict(drop_policy="probs", pad_to_capacity=True)),
    ("ep2tp2", Case(2, 7, 2, 1), dict(drop_policy="position")),  # dropped rows x etp replicas
    ("tp2ep2", Case(2, 7, 2, 1), dict(drop_policy="probs", score_before_experts=True)),
    ("etp2_gather", Case(2, 7, 1, 0), dict(drop_policy="position", pad_to_capacity=True)),
    ("sp2ep2", Case(1, 1, 2, 0), dict(drop_policy="probs")),  # a tp rank with no token
    ("sp2ep2", Case(1, 1, 2, 0), dict(drop_policy="position", pad_to_capacity=True)),
]


class CapacityParityTest(DistTestBase):
    @with_comms
    def test_ep_and_sp_drop_as_one_device(self):
        # Without pad_to_capacity both EP exchanges run: the one-node overlapped step (the
        # dropped pairs sort last and are not sent) and the plain functional-collective path.
        for name, case, options in RUNS:
            for overlap in (True,) if options.get("pad_to_capacity") else (True, False):
                run = ShardwiseRun(
                    LAYOUTS[name], case, self.rank, overlap=overlap, **CAPACITY, **options
                )
                run_steps(run, f"{name} {case} {options} overlap={overlap}")

    @with_comms
    def test_capacity_under_tp_and_sp_raises_no_future_warning(self):
        """The routing-table all-gather of a capacity under tp uses the current
        functional-collective API: a training step under SP and under TP runs with torch's
        FutureWarnings (deprecated collectives) turned into errors, and matches one device."""
        for name in ("sp2ep2", "tp2ep2"):
            run = ShardwiseRun(LAYOUTS[name], Case(2, 7, 2, 0), self.rank, **CAPACITY)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)

                def check(actual, expected, what, name=name):
                    close(actual, expected, f"{name} under FutureWarning=error: {what}")

                run.step(check)

    @with_comms
    def test_fixed_capacity_with_different_batches_per_rank(self):
        """``capacity_per_expert`` under EP4: every rank routes a batch of its own length (5 to
        8 tokens a sequence, changing every step), both exchanges: the static one
        (``pad_to_capacity``) and the overlapped and plain unpadded ones."""
        for options, overlaps in (
            (dict(drop_policy="position", pad_to_capacity=True), (True,)),
            (dict(drop_policy="probs"), (True, False)),
        ):
            for overlap in overlaps:
                run = RaggedRun(
                    LAYOUTS["ep4"], Case(2, 5, 2, 1), self.rank, overlap=overlap,
                    capacity_per_expert=2, **options,
                )
                run_steps(run, f"ep4 ragged {options} overlap={overlap}")

    @with_comms
    def test_static_exchange_has_no_count_exchange(self):
        """Note [Static exchange at capacity]: 2 forward all-to-alls instead of 3 (no count
        exchange), and no host read of sizes. Without padding the one-node overlapped step runs
        (its exchanges are ``c10d.alltoall_base_``), with the count exchange."""
        counts = {}
        for padded in (False, True):
            meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
            torch.manual_seed(0)
            moe = parallelize_moe(
                MoE(make_config(Case(2, 7, 2, 0), **CAPACITY, pad_to_capacity=padded)), meshes,
                sequence_parallel=False,
            )
            x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(self.rank))
            moe(x).sum().backward()  # the first training forward runs the identical-token check
            with CommDebugMode() as comm:
                y = moe(x.clone().requires_grad_())
            forward = {str(k): v for k, v in comm.get_comm_counts().items()}
            with CommDebugMode() as comm:
                y.sum().backward()
            backward = {str(k): v for k, v in comm.get_comm_counts().items()}
            counts[f"pad_to_capacity={padded}"] = f"forward {forward}, backward {backward}"
        self.assertExpectedInline(
            "\n".join(f"{k}: {v}" for k, v in counts.items()),
            """\
pad_to_capacity=False: forward {'c10d.alltoall_base_': 3}, backward {'c10d.alltoall_base_': 2}
pad_to_capacity=True: forward {'c10d.alltoall_base_': 2}, backward {'c10d.alltoall_base_': 2}""",  # noqa: E501
        )

    @with_comms
    def test_static_exchange_needs_equal_capacity(self):
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        moe = parallelize_moe(
            MoE(make_config(Case(2, 7, 2, 0), **CAPACITY, pad_to_capacity=True)), meshes,
            sequence_parallel=False,
        )
        gen = torch.Generator().manual_seed(self.rank)
        x = torch.randn(2, 7 if self.rank else 9, 16, generator=gen)  # rank 0 routes more
        with self.assertRaisesRegex(
            ValueError,
            r"needs the same expert capacity on every rank, got rank 0: 3, rank 1: 2, rank 2: "
            r"2, rank 3: 2 .* give every rank the same batch shape \(B, L\), or set a fixed "
            r"capacity_per_expert instead",
        ):
            moe(x)


# CI: the static path's parity on EP4 and its breaks on EP and SP layouts (EP4's training counts
# are those of its parity compile, pinned in test_compiled_matches_eager, so it compiles once; the
# SP2 + EP2 break count compiles and runs the static path under SP; the island, without
# pad_to_capacity, runs the eager code, whose parity and breaks tests/test_parallel_compile.py
# checks for dropless); DTENSOR_MOE_FULL_MATRIX=1 adds the static path's parity on SP2 + EP2, the
# island's parity on both layouts, its breaks on ep4, and the static path's breaks under EP x TP.
COMPILE_RUNS = [("ep4", True)] + (
    [("sp2ep2", True), ("ep4", False), ("sp2ep2", False)]
    if os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1" else []
)
BREAK_RUNS = [("ep4", True, False), ("sp2ep2", True, True)]  # ep4 padded train: with its parity
FULL_BREAK_RUNS = [("ep4", False, True), ("ep2tp2", True, True)]


class CapacityCompileTest(DistTestBase):
    """Under ``torch.compile``: the exchange runs in the layer's eager island, with
    ``pad_to_capacity`` (the static exchange, Note [Static exchange at capacity]) or without it,
    as dropless. Both match the same layer run eagerly."""

    _model = test_parallel_compile.ParallelCompileTest._model
    _input = test_parallel_compile.ParallelCompileTest._input
    _fwd_bwd = test_parallel_compile.ParallelCompileTest._fwd_bwd
    _compare = test_parallel_compile.ParallelCompileTest._compare
    _check = test_parallel_compile.ParallelCompileTest._check
    _compiled_counts = test_parallel_compile.ParallelCompileTest._compiled_counts

    @with_comms
    def test_compiled_matches_eager(self):
        for name, padded in COMPILE_RUNS:
            model = self._model(name, **CAPACITY, pad_to_capacity=padded)[0]
            if (name, padded) != ("ep4", True):
                self._check(name, model, "aot_eager", steps=2)
                continue
            # EP4 padded: 3 steps, and the compile's (graphs, breaks, recompiles) over them in
            # training, as test_graph_breaks_are_pinned counts (and explains) the others
            counts = {}
            self._check(name, model, "aot_eager", steps=3, counts=counts)
            v = counts[name]
            self.assertExpectedInline(
                f"ep4 padded train: graphs={v[0]} breaks={v[1]} recompiles={v[2]}",
                """ep4 padded train: graphs=2 breaks=1 recompiles=0""",
            )

    @with_comms
    def test_graph_breaks_are_pinned(self):
        results = {}
        full = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
        for name, padded, train in BREAK_RUNS + (FULL_BREAK_RUNS if full else []):
            model, meshes, layout = self._model(name, **CAPACITY, pad_to_capacity=padded)
            x, g = self._input(meshes, layout, seed=19)
            self._fwd_bwd(model, x, g)  # eager: the one-time identical-token check
            model.train(train)
            key = f"{name} {'padded' if padded else 'unpadded'} {'train' if train else 'eval'}"
            results[key] = self._compiled_counts(model, meshes, layout)
        # (graphs, breaks, recompiles) over 3 steps with new data. Since the routed path runs in
        # stages (#30), the static exchange at capacity runs in the layer's eager island like
        # every other EP exchange (AllToAllExchange.reads_host_sizes is always true), padded or
        # not, as for the dropless layer (tests/test_parallel_compile.py): the one break is the
        # island, in eval as in training (the router counter update runs in it, Note [MoE under
        # torch.compile]), and the layer is two graphs, before and after the island. Under
        # tensor/sequence parallelism the style's input pre-hook (TokenParallel.input_hook,
        # which builds the rank's global token indices) is compiled as a frame of its own: one
        # graph more and no more breaks (ep2tp2 and sp2ep2: 3, as dropless ep2tp2 in
        # test_parallel_compile.py).
        lines = [f"{k}: graphs={v[0]} breaks={v[1]} recompiles={v[2]}" for k, v in results.items()]
        if full:  # the island (unpadded) and EP x TP
            self.assertExpectedInline(
                "\n".join(lines[len(BREAK_RUNS):]),
                """\
ep4 unpadded train: graphs=2 breaks=1 recompiles=0
ep2tp2 padded train: graphs=3 breaks=1 recompiles=0""",
            )
        self.assertExpectedInline(
            "\n".join(lines[: len(BREAK_RUNS)]),
            """\
ep4 padded eval: graphs=2 breaks=1 recompiles=0
sp2ep2 padded train: graphs=3 breaks=1 recompiles=0""",
        )


if __name__ == "__main__":
    run_tests()
