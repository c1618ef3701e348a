"""The fixed-buffer exchange (Note [Fixed-buffer exchange] in ``dtensor_moe/routed/fixed.py``),
4 gloo ranks: parity with one process under every EP layout, its overflow policies (strict and
re-run), no host read in a training step, and the layer compiled whole.

Shape legend: B sequences per data shard, L tokens per sequence, D dim, E experts.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy
import math
import os
from unittest import mock

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_moe import MoE, _compat, build_moe_meshes, parallelize_moe
from dtensor_moe.moe import collect_aux_losses
from dtensor_moe.routed.exchange import set_after_launch
from dtensor_moe.routed.fixed import (
    FixedBufferExchange,
    check_exchanges,
    exchange_overflowed,
    needed_buffer_factor,
    reset_overflow,
    set_buffer_factor,
    step_without_overflow,
)
from tests import _moe_layouts as layouts_tests
from tests import test_fsdp_moe as fsdp_tests  # (its test class would rerun here)
from tests import test_pipeline_schedule as schedule_tests
from tests._dist import DistTestBase
from tests.test_capacity_dist import CAPACITY, ShardwiseRun
from tests._moe_model import global_batch, make_model
from tests.test_exchange_backends import exchanges_of, pipeline_exchange
from tests.test_pipeline_overlap import dualpipe_v_overlapped
from tests.test_parallel_moe import LAYOUTS, Case, ParallelRun, make_config, run_steps

CASE = Case(2, 8, 2, 1)  # an even sequence: the same buffer on every rank under SP
FULL = os.environ.get("DTENSOR_MOE_FULL_MATRIX") == "1"
D = 16


class SkewedRun(ParallelRun):
    """Every token's selection pushed to experts 0 and 1 (rank 0's, under EP4) by a large
    expert bias, which changes the routing but not the combine weights: at ``buffer_factor``
    1.0 the pairs towards rank 0 cannot fit. Its forward and backward run through
    :func:`step_without_overflow`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for model in (self.ref, self.model):
            with torch.no_grad():
                model.router.expert_bias[:2] = 100.0
        set_buffer_factor(self.model, 1.0)
        self.runs = 0

    def distributed_forward_backward(self):
        def step():
            self.runs += 1
            return super(SkewedRun, self).distributed_forward_backward()

        return step_without_overflow(self.model, step)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a device value on the host or give it a data-dependent shape."""

    READS = {"_local_scalar_dense", "nonzero", "item", "masked_select", "unique"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class NanIntoCollectives(TorchDispatchMode):
    """Records the collectives (c10d's, as the eager exchange runs them, and the functional
    ones) that get a NaN in a tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.checked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the collectives themselves (not wait_tensor, nor the wrap of a buffer being filled)
        if func.namespace == "c10d" and func.__name__.startswith(("all", "reduce")) or (
            func.namespace == "_c10d_functional" and func.__name__.startswith(("all_", "reduce"))
        ):
            self.checked += 1
            sent = args[1:2] if func.__name__.startswith("alltoall_base_") else args  # not its output
            if any(isinstance(a, torch.Tensor) and a.is_floating_point() and bool(a.isnan().any())
                   for a in sent):  # fmt: skip
                self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class FixedExchangeTest(DistTestBase):
    @with_comms
    def test_every_ep_layout_matches_one_process(self):
        """3 training steps of each EP layout with the fixed exchange, against one process:
        output, input grad, every param grad, aux loss, expert bias, params (at 1e-5)."""
        layouts = ["ep4", "sp2ep2", "ep2tp2"] + (
            ["ep2", "sp2ep4", "ep2tp2_gather", "tp2ep2"] if FULL else []
        )
        for name in layouts:
            run_steps(ParallelRun(LAYOUTS[name], CASE, self.rank, exchange="fixed"), name)
        run = ParallelRun(LAYOUTS["ep4"], CASE, self.rank, exchange="fixed",
                          score_before_experts=True, hidden_dim=8)  # fmt: skip
        run_steps(run, "ep4 score_before_experts, H < D")

    @with_comms
    def test_matches_the_all_to_all_exchange(self):
        """With no overflow, the same output and gradients as the all-to-all exchange with
        every row sent (``overlap=False``), bit for bit: the received rows are grouped in the
        same order and the grouped matmuls end at the last real row, so each expert's group is
        the same rows in both. It hands over at each of its 3 forward and 2 backward launches
        (``overlap_f_b``'s turns)."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        ref = MoE(make_config(CASE))
        x = torch.randn(CASE.B, CASE.L, D, generator=torch.Generator().manual_seed(self.rank))
        results = []
        launches: list[str] = []  # the hand-over points of overlap_f_b, forward and backward
        for exchange, overlap in (("fixed", True), ("all_to_all", False)):
            model = parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False,
                                    exchange=exchange, ep_overlap=overlap)  # fmt: skip
            xi = x.clone().requires_grad_()
            hook = (lambda: launches.append("B" if _compat.in_backward_pass() else "F")) \
                if exchange == "fixed" else None  # fmt: skip
            previous = set_after_launch(hook)
            try:
                y = model(xi)
                y.square().sum().backward()
            finally:
                set_after_launch(previous)
            results.append([y, xi.grad, *(p.grad.to_local() if hasattr(p.grad, "to_local")
                                          else p.grad for p in model.parameters())])  # fmt: skip
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        self.assertEqual(launches, ["F"] * 3 + ["B"] * 2)  # counts, rows, outputs; 2 back

    @with_comms
    def test_unwritten_rows_reach_no_output_or_gradient(self):
        """Note [Rows past the last offset]: with every ``torch._grouped_mm`` row past the last
        offset set to NaN (what an unwritten row may hold), in forward and in backward, a
        training step under EP4 sends no NaN through any collective (which NCCL's
        ``TORCH_NCCL_NAN_CHECK`` would refuse) and gives the same output and gradients."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        ref = MoE(make_config(CASE, aux_loss_coeff=0.0))
        x = torch.randn(CASE.B, CASE.L, D, generator=torch.Generator().manual_seed(self.rank))
        real = torch._grouped_mm

        def nan_past_the_last_offset(a, b, *args, offs=None, **kwargs):
            out = real(a, b, *args, offs=offs, **kwargs)
            if out.dim() == 2 and offs is not None:  # rows grouped (not a weight gradient)
                with torch.no_grad():
                    out[int(offs[-1]):] = float("nan")
            return out

        results = []
        for patched in (False, True):
            model = parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False,
                                    exchange="fixed")  # fmt: skip
            xi = x.clone().requires_grad_()
            with mock.patch.object(torch, "_grouped_mm",
                                   nan_past_the_last_offset if patched else real), \
                    NanIntoCollectives() as mode:  # fmt: skip
                y = model(xi)
                y.square().sum().backward()
            self.assertEqual(mode.seen, [])
            self.assertGreaterEqual(mode.checked, 5)  # forward 3, backward 2
            results.append([y, xi.grad, *(p.grad.to_local() if hasattr(p.grad, "to_local")
                                          else p.grad for p in model.parameters())])  # fmt: skip
        for a, b in zip(*results, strict=True):
            self.assertTrue(bool(torch.isfinite(b).all()))
            torch.testing.assert_close(b, a, rtol=0, atol=0)

    @with_comms
    def test_pipeline_schedules_fsdp2_and_grad_scaler_match_one_process(self):
        """pp2 x dp2 with EP2 over each stage's dp ranks, every stage's experts on the fixed
        exchange with a ``buffer_factor`` of 2 (= ep: every row fits), 3 steps each against one
        process (losses, every param grad, params, router counters;
        ``tests/test_pipeline_schedule.py``'s harness): ``Schedule1F1B``; the same with FSDP2
        in every stage and a ``GradScaler``; ``ScheduleInterleaved1F1B`` with two stages a
        rank; ``ScheduleDualPipeV`` under ``overlap_f_b`` (the fixed exchange hands over at each
        launch, forward and backward)."""
        runs = [
            (Schedule1F1B, "single", {}),
            (Schedule1F1B, "single",
             {"fsdp": True, "scaler": torch.amp.GradScaler("cpu", init_scale=16.0)}),
            (ScheduleInterleaved1F1B, "loop", {}),
            (dualpipe_v_overlapped, "v", {}),
        ]  # fmt: skip
        for schedule_cls, style, options in runs:
            stages: list = []
            with pipeline_exchange("fixed", stages, buffer_factor=2.0):
                schedule_tests.check_training(self, schedule_cls, style, **options)
            self.assertEqual(exchanges_of(stages), {"fixed"})

    @with_comms
    def test_fsdp2_layouts_match_one_process(self):
        """FSDP2 with EP2 over dp4, and with SP2 + EP4 (sequences tp divides), the experts on
        the fixed exchange with a ``buffer_factor`` of ep (every row fits, whatever the
        routing): 5 steps of forward, backward, clip and one fused AdamW against one device
        (``tests/test_fsdp_moe.py``'s harness)."""
        real = layouts_tests.parallelize_moe

        def fixed(module, meshes, **options):  # a factor of ep: no destination can overflow
            return real(module, meshes, exchange="fixed", **options,
                        exchange_options={"buffer_factor": float(meshes.ep)})  # fmt: skip

        for name in ("dp4_ep2", "dp2_tp2_ep4_sp"):
            ref = make_model()
            with mock.patch.object(layouts_tests, "parallelize_moe", fixed):
                model, opt = layouts_tests.build_layout(name, copy.deepcopy(ref))
            self.assertEqual(exchanges_of([model]), {"fixed"})
            self.assertTrue(any(isinstance(m, FSDPModule) for m in model.modules()))
            batches = [global_batch(s, batch=8, seq_len=6) for s in range(fsdp_tests.STEPS)]
            rows = layouts_tests.local_rows(name, self.rank, 8)
            losses = fsdp_tests.FSDPMoETest._train(self, model, opt, batches, local_rows=rows)
            ref_losses = fsdp_tests.FSDPMoETest._reference(self, ref, batches)
            for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
                torch.testing.assert_close(fsdp_tests._avg(got), want, rtol=fsdp_tests.RTOL,
                                           atol=fsdp_tests.ATOL, msg=f"{name} loss {step}")  # fmt: skip
            fsdp_tests.FSDPMoETest._assert_params_match(self, model, ref, name)

    @with_comms
    def test_capacity_drops_as_one_device(self):
        """Note [Expert capacity]: a capacity without ``pad_to_capacity`` (the mode it supports)
        drops the same pairs as one device running each data shard, under EP4, with a factor
        of ep (every kept row fits): 3 steps, output, input and every param gradient, aux loss,
        bias and dropped pairs per expert; ``pad_to_capacity`` is refused by name
        (``tests/test_exchange_backends.py``)."""
        for options in (dict(drop_policy="probs"), dict(drop_policy="position")):
            run = ShardwiseRun(LAYOUTS["ep4"], Case(2, 7, 2, 1), self.rank, exchange="fixed",
                               **CAPACITY, **options)  # fmt: skip
            self.assertEqual(run.model.experts.exchange.name, "fixed")
            set_buffer_factor(run.model, 4.0)
            run_steps(run, f"ep4 fixed {options}")
            self.assertFalse(exchange_overflowed(run.model))

    @with_comms
    def test_uneven_shards_match_one_process(self):
        """Note [The agreed size]: under SP with a sequence that tp does not divide, the ranks
        route 16 and 12 pairs; the buffers are sized for 16 on every rank, and 3 training
        steps match one process."""
        run = ParallelRun(LAYOUTS["sp2ep2"], Case(2, 7, 2, 1), self.rank, exchange="fixed")
        run_steps(run, "sp2ep2 fixed, L=7")
        self.assertEqual(run.model.experts.exchange.agreed_pairs, 16)
        self.assertFalse(exchange_overflowed(run.model))

    @with_comms
    def test_batches_that_change_on_some_ranks(self):
        """Note [The agreed size]: batch sizes that change on some ranks only (a ragged batch,
        then a batch that grew) run no collective the other ranks do not reach, and give the
        all-to-all exchange's output and gradients bit for bit. Step 1: 16 tokens on every
        rank (32 pairs, agreed at the first forward). Step 2: ranks 1 and 3 route 8 tokens
        (smaller: the same buffers, less filled). Step 3, at factor 1.0: rank 0 routes 24
        tokens (48 pairs): the strict policy names the batch that grew and the size; the read
        raised the agreed size on every rank, and the same step run again fits. Step 4, at
        factor 1.5: rank 2 routes 48 tokens; ``step_without_overflow`` runs it again at the
        grown size, and leaves the factor as it was."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        ref = MoE(make_config(CASE))
        models = {name: parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False,
                                        exchange=name, ep_overlap=False)
                  for name in ("fixed", "all_to_all")}  # fmt: skip
        fixed = models["fixed"].experts.exchange
        gen = torch.Generator().manual_seed(self.rank)
        lengths = {1: 8, 2: 4 if self.rank in (1, 3) else 8, 3: 12 if self.rank == 0 else 8,
                   4: 24 if self.rank == 2 else 8}

        def step(name, x):
            model = models[name]
            for p in model.parameters():
                p.grad = None
            xi = x.clone().requires_grad_()
            y = model(xi)
            y.square().sum().backward()
            return [y, xi.grad, *(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                  for p in model.parameters())]  # fmt: skip

        for number, L in lengths.items():
            x = torch.randn(2, L, D, generator=gen)
            expected = step("all_to_all", x)
            got = step("fixed", x)
            if number == 4:  # 96 pairs on rank 2 against buffers of 24 rows: a re-run, and no
                runs = []  # growth of the factor, as the agreed size grew
                got = step_without_overflow(models["fixed"],
                                            lambda: runs.append(1) or step("fixed", x))  # fmt: skip
                self.assertEqual((len(runs), fixed.agreed_pairs, fixed.buffer_factor),
                                 (2, 96, 1.5))  # fmt: skip
            if number == 3:  # 48 pairs on rank 0 against buffers sized for 32, at factor 1
                with self.assertRaisesRegex(
                    RuntimeError,
                    r"the fixed exchange of 'experts' over DeviceMesh\(.*\) had \d+ rows that "
                    r"did not fit its buffer of 8 rows towards rank \d: a rank routed 48 pairs, "
                    r"more than the 32 the buffers were sized for \(a batch that grew\)",
                ):
                    check_exchanges(models["fixed"])
                self.assertEqual(fixed.agreed_pairs, 48)
                got = step("fixed", x)  # C = 1.0 * 48 / 4 = 12, rounded up to 16
            check_exchanges(models["fixed"])  # nothing did not fit
            # 1.25 * 32 / 4, then 1.0 * 48 / 4, then 1.5 * 96 / 4, rounded up to 8
            self.assertEqual(fixed.last_rows_per_pair, 40 if number == 4 else 16)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            if number == 2:
                self.assertEqual(fixed.agreed_pairs, 32)  # a smaller batch leaves it
                set_buffer_factor(models["fixed"], 1.0)  # C = 8: step 3 cannot fit on rank 0
            if number == 3:
                set_buffer_factor(models["fixed"], 1.5)  # C = 24: step 4 cannot fit on rank 2

    @with_comms
    def test_strict_policy_names_the_layer_the_pair_and_the_factor(self):
        """Rows that do not fit are recorded on the device and read once: the same error on
        every rank, naming the layer, the rank pair, the rows and the factor that holds them."""
        run = SkewedRun(LAYOUTS["ep4"], CASE, self.rank, exchange="fixed")
        ParallelRun.distributed_forward_backward(run)  # the step itself does not read
        self.assertTrue(exchange_overflowed(run.model))
        self.assertEqual(needed_buffer_factor(run.model), 4.0)  # 32 rows, a share of 8
        with self.assertRaisesRegex(
            RuntimeError,
            r"the fixed exchange of 'experts' over DeviceMesh\(.*\) had 24 rows that did not "
            r"fit its buffer of 8 rows towards rank 0 \(buffer_factor=1.0\); a buffer_factor of "
            r"4.00 would have held them",
        ):
            check_exchanges(run.model)
        self.assertFalse(exchange_overflowed(run.model))  # the records are reset
        self.assertEqual(needed_buffer_factor(run.model), 0.0)
        check_exchanges(run.model)

    @with_comms
    def test_rerun_policy_trains_as_one_process(self):
        """``step_without_overflow``: the overflowed run leaves no grad, counter or bias behind,
        the factor grows on every rank, and 3 steps match one process."""
        run = SkewedRun(LAYOUTS["ep4"], CASE, self.rank, exchange="fixed")
        run_steps(run, "ep4 skewed, re-run")
        exchange = run.model.experts.exchange
        self.assertIsInstance(exchange, FixedBufferExchange)
        self.assertGreater(run.runs, 3)  # at least one re-run
        self.assertGreaterEqual(exchange.buffer_factor, 1.5)

    @with_comms
    def test_a_training_step_reads_nothing_on_the_host(self):
        """After the first step (the one-time checks), a training step of the fixed exchange
        under EP4 reads no device value on the host; the all-to-all exchange reads its sizes."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        config = make_config(CASE, aux_loss_coeff=0.0, use_expert_bias=False)
        x = torch.randn(CASE.B, CASE.L, D, generator=torch.Generator().manual_seed(self.rank))
        reads = {}
        for exchange in ("fixed", "all_to_all"):
            model = parallelize_moe(MoE(config), meshes, sequence_parallel=False,
                                    exchange=exchange)  # fmt: skip
            model(x).sum().backward()
            calls: list[str] = []

            def counting(name, real):
                def method(t, *args, **kwargs):
                    calls.append(name)
                    return real(t, *args, **kwargs)

                return method

            with mock.patch.object(torch.Tensor, "tolist", counting("tolist", torch.Tensor.tolist)), \
                    mock.patch.object(torch.Tensor, "item", counting("item", torch.Tensor.item)), \
                    HostReads() as mode:  # fmt: skip
                with collect_aux_losses():
                    model(x).sum().backward()
            reads[exchange] = (len(calls) + len(mode.seen))
        self.assertEqual(reads["fixed"], 0)
        self.assertEqual(reads["all_to_all"], 3)

    def _eager_and_traced(self):
        """Two copies of one EP4 layer with the fixed exchange, each after one eager step (the
        one-time checks: the agreed size), and 6 batches of this rank's data."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        ref = MoE(make_config(CASE, aux_loss_coeff=0.0))
        models = [parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False,
                                  exchange="fixed") for _ in range(2)]  # fmt: skip
        g = torch.Generator().manual_seed(self.rank)
        xs = [torch.randn(CASE.B, CASE.L, D, generator=g) for _ in range(6)]
        for model in models:
            model(xs[0]).sum().backward()
            model.zero_grad()
        return (*models, xs)

    def _assert_grads_match(self, eager, traced):
        for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
            ga = a.grad.to_local() if hasattr(a.grad, "to_local") else a.grad
            gb = b.grad.to_local() if hasattr(b.grad, "to_local") else b.grad
            scale = ga.abs().max().item()  # inductor's fusions round differently
            torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-5 * scale, msg=name)

    @with_comms
    def test_compiled_training(self):
        """``torch.compile`` (inductor) of the parallel layer with the fixed exchange, after
        one eager step: over 5 training steps of new data one graph, one break (the router's
        counter update, last), no recompile; outputs and every grad match eager at 1e-5 (of
        each grad's largest entry: inductor's fused kernels round differently). Pairs that do
        not fit (every token pushed to rank 0's experts) run in the same graph and match eager;
        a grown factor costs one more compile and still matches."""
        eager, traced, xs = self._eager_and_traced()
        compiled = torch.compile(traced)
        torch._dynamo.reset()
        counters.clear()
        for x in xs[1:]:
            y_e, y_c = eager(x), compiled(x)
            y_e.square().sum().backward()
            y_c.square().sum().backward()
            torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
            self._assert_grads_match(eager, traced)
            eager.zero_grad()
            traced.zero_grad()
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        self.assertEqual(sum(counters["graph_break"].values()), 1)
        # pairs that do not fit (every token pushed to rank 0's experts: 4 shares into a
        # buffer of 1.25): eager reads the void slot's zero row, compiled masks them (Note
        # [The void slot]); the same graph, the same outputs and grads
        for model in (eager, traced):
            with torch.no_grad():
                model.router.expert_bias[:2] = 100.0
            reset_overflow(model)
        y_e, y_c = eager(xs[2]), compiled(xs[2])
        y_e.square().sum().backward()
        y_c.square().sum().backward()
        self.assertTrue(exchange_overflowed(eager) and exchange_overflowed(traced))
        torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
        self._assert_grads_match(eager, traced)
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        # a grown factor (what step_without_overflow does): one more compile, still as eager
        # (Note [The factor as text]; test_compiled_evaluation_whole shows the float failing)
        for model in (eager, traced):
            set_buffer_factor(model, 1.875)
            model.zero_grad()
        y_e, y_c = eager(xs[1]), compiled(xs[1])
        torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
        (y_e.square().sum() + y_c.square().sum()).backward()
        self._assert_grads_match(eager, traced)
        self.assertEqual(traced.experts.exchange.last_rows_per_pair, 16)  # was 8
        self.assertEqual(counters["stats"]["unique_graphs"], 2)
        dist.barrier()

    @with_comms
    def test_compiled_evaluation_whole(self):
        """In evaluation, ``torch.compile(layer, fullgraph=True)`` with inductor: one graph
        over 5 steps of new data, outputs as eager at 1e-5. And why the factor is kept as
        text (Note [The factor as text]): the same layer in training, with the factor as a float
        attribute, fails to compile once the factor changes (torch 2.13)."""
        eager, traced, xs = self._eager_and_traced()
        eager.eval()
        traced.eval()
        torch._dynamo.reset()
        counters.clear()
        whole = torch.compile(traced, fullgraph=True)
        with torch.no_grad():
            for x in xs[1:]:
                torch.testing.assert_close(whole(x), eager(x), rtol=1e-5, atol=1e-6)
        self.assertEqual(counters["stats"]["unique_graphs"], 1)

        def float_rows(exchange, num_pairs):
            share = exchange.factor_float * num_pairs / exchange.mesh.size()
            return max(8, -(-math.ceil(share) // 8) * 8)

        traced.train()  # (in evaluation the float compiles: the failure is in training)
        traced.experts.exchange.factor_float = 1.25
        torch._dynamo.reset()
        with mock.patch.object(FixedBufferExchange, "rows_per_pair", float_rows):
            compiled_float = torch.compile(traced, backend="aot_eager")  # (dynamo fails)
            compiled_float(xs[0]).sum().backward()
            traced.experts.exchange.factor_float = 1.875
            with self.assertRaisesRegex(Exception, "CeilToInt"):
                compiled_float(xs[1]).sum().backward()
        dist.barrier()


def test_grouped_mm_leaves_rows_past_the_last_offset():
    """Why the fixed exchange guards its rows (Note [Rows past the last offset]): torch 2.13's
    ``torch._grouped_mm`` computes no row past its last offset, in forward or in the input
    gradient; those rows hold whatever the buffer held, not the product."""
    torch.manual_seed(0)
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(2, 16, 16, requires_grad=True)
    offs = torch.tensor([8, 24], dtype=torch.int32)
    out = torch._grouped_mm(x, w, offs=offs)
    torch.testing.assert_close(out[:8], x[:8] @ w[0])
    torch.testing.assert_close(out[8:24], x[8:24] @ w[1])
    assert not torch.equal(out[24:], x[24:] @ w[1])  # unwritten: not the product
    (grad_x,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(grad_x[:8], torch.ones(8, 16) @ w[0].T)
    torch.testing.assert_close(grad_x[8:24], torch.ones(16, 16) @ w[1].T)
    assert not torch.equal(grad_x[24:], torch.ones(40, 16) @ w[1].T)


if __name__ == "__main__":
    run_tests()
