"""The exchange backends beyond the parity matrix (Note [Exchange protocol] in
``dtensor_moe/routed/exchange.py``): the all-gather backend (Note [All-gather exchange]) under
expert capacity and a pipeline schedule, its refusals, its collectives next to the all-to-all's,
and the protocol's errors.

On 4 gloo ranks, each against one process with the same weights, through the harnesses of
``tests/test_capacity_dist.py`` (capacity: 3 steps, outputs, input and every param gradient,
dropped pairs) and ``tests/test_pipeline_schedule.py`` (3 ``Schedule1F1B`` steps: losses,
every param gradient, params, router counters), at their 1e-5 relative tolerance. The protocol's
errors run in one process, but for the two that need a mesh (``'local'`` on one, an unknown
name given to ``parallelize_moe``). ``tests/test_parallel_moe.py::test_all_gather_exchange``
runs the all-gather backend through the EP parity matrix.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import ExpertParallel, ExpertTensorParallel, MoE, build_moe_meshes
from dtensor_moe.parallel import overlap_f_b, parallelize_moe
from dtensor_moe.routed import (
    AllGatherExchange,
    AllToAllExchange,
    LocalExchange,
    TokenExchange,
    exchange_names,
    register_exchange,
)
from tests import test_pipeline_schedule as schedule_tests  # (its test class would rerun here)
from tests._dist import DistTestBase
from tests.test_capacity_dist import CAPACITY, ShardwiseRun
from tests.test_parallel_moe import LAYOUTS, Case, make_config, run_steps
from tests.test_parallel_styles import COUNT_CASE, _counts, _input, _local_loss

# capacity_factor without pad_to_capacity, one case per layout kind (EP over data ranks; SP with
# EP borrowing the tp ranks): B=2, L=7 (uneven shards), top-2, a shared expert
CAPACITY_RUNS = [
    ("ep4", dict(drop_policy="probs")),
    ("sp2ep2", dict(drop_policy="position")),
]


def _registered() -> str:
    """The registered names, as the unknown-name errors list them, as a regex."""
    return re.escape(str(list(exchange_names())))


@contextmanager
def pipeline_exchange(exchange: str, stages: list, **exchange_options):
    """Build the pipelines of ``tests/test_pipeline_schedule.py`` with ``exchange`` experts (and
    the backend's ``exchange_options``); each stage module that ``parallelize_moe`` returns is
    appended to ``stages``."""
    real = schedule_tests.parallelize_moe

    def with_exchange(module, meshes, **options):
        stages.append(real(module, meshes, exchange=exchange, **options,
                           exchange_options=exchange_options or None))  # fmt: skip
        return stages[-1]

    with mock.patch.object(schedule_tests, "parallelize_moe", with_exchange):
        yield


def exchanges_of(modules: list) -> set[str]:
    """The names of the exchange backends the MoE layers of ``modules`` run."""
    return {m.experts.exchange.name for module in modules for m in module.modules()
            if isinstance(m, MoE)}  # fmt: skip


class AllGatherExchangeTest(DistTestBase):
    @with_comms
    def test_capacity_drops_as_one_device(self):
        """Note [Expert capacity]: without ``pad_to_capacity`` the all-gather backend drops the
        same pairs as one device running each data shard, and matches it (3 steps: output,
        input and every param gradient, aux loss, bias, dropped pairs per expert)."""
        for name, options in CAPACITY_RUNS:
            run = ShardwiseRun(LAYOUTS[name], Case(2, 7, 2, 1), self.rank,
                               exchange="all_gather", **CAPACITY, **options)  # fmt: skip
            self.assertEqual(run.model.experts.exchange.name, "all_gather")
            run_steps(run, f"{name} all_gather {options}")

    @with_comms
    def test_pad_to_capacity_is_refused_before_any_collective(self):
        """``static_capacity = False``: ``parallelize_moe`` refuses it before any collective,
        and, with the style applied by hand, the first training forward raises on every rank,
        naming the backend, and issues no collective (not even the identical-token check)."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        torch.manual_seed(0)
        config = make_config(Case(2, 7, 2, 0), **CAPACITY, pad_to_capacity=True)
        with CommDebugMode() as comm, self.assertRaisesRegex(
            ValueError,
            r"parallelize_moe: the 'all_gather' exchange does not support pad_to_capacity \(the "
            r"static exchange at capacity\), which a layer's MoEConfig sets; set "
            r"pad_to_capacity=False or use exchange='all_to_all'",
        ):
            parallelize_moe(MoE(config), meshes, sequence_parallel=False, exchange="all_gather")
        self.assertEqual(comm.get_total_counts(), 0, comm.get_comm_counts())
        moe = MoE(config)
        parallelize_module(moe.experts, meshes.expert["ep"], ExpertParallel(exchange="all_gather"))
        x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(self.rank))
        with CommDebugMode() as comm:
            with self.assertRaisesRegex(
                ValueError,
                r"the 'all_gather' exchange does not support pad_to_capacity \(the static "
                r"exchange at capacity\); set MoEConfig.pad_to_capacity=False or use "
                r"exchange='all_to_all'",
            ):
                moe(x.requires_grad_())
        self.assertEqual(comm.get_total_counts(), 0, comm.get_comm_counts())

    @with_comms
    def test_pipeline_schedule_matches_one_process(self):
        """pp2 x dp2 with EP2 over each stage's dp ranks, ``Schedule1F1B``, every stage's
        experts on the all-gather backend: 3 steps against one process."""
        stages: list = []
        with pipeline_exchange("all_gather", stages):
            schedule_tests.check_training(self, Schedule1F1B, "single")
        self.assertEqual(exchanges_of(stages), {"all_gather"})

    @with_comms
    def test_overlap_f_b_refuses_the_all_gather_exchange(self):
        """``hands_over_launches = False``: ``overlap_f_b`` refuses a stage that uses it, by
        name, on every rank, where the same schedule with the all-to-all backend passes."""
        for exchange in ("all_to_all", "all_gather"):
            stages: list = []
            with pipeline_exchange(exchange, stages):
                pipe = schedule_tests.build_pipeline(self, ScheduleDualPipeV, "v")
            self.assertEqual(exchanges_of(stages), {exchange})
            if exchange == "all_to_all":
                self.assertIs(overlap_f_b(pipe.schedule), pipe.schedule)
                continue
            with self.assertRaisesRegex(
                ValueError,
                r"overlap_f_b: stage \d's experts 'layers\.\d\.moe\.experts' use the "
                r"'all_gather' exchange, which does not hand over to the other micro-batch at "
                r"its launches \(hands_over_launches=False\), so nothing would overlap; "
                r"parallelize the experts with exchange='all_to_all'",
            ):
                overlap_f_b(pipe.schedule)

    @with_comms
    def test_collective_counts(self):
        """One training forward and backward of an EP4 layer (B=2, L=7, top-2, one shared
        expert), counted on the second step (the first adds the identical-token check, and the
        fixed exchange's agreement on its buffer size), for each backend. All-gather: the sizes,
        the tokens with their weights, the ids, then the outputs' reduce-scatter; its backward
        mirrors the two that carry gradients. Fixed: the counts, the rows, the outputs; its
        backward, the two gradients."""
        lines = []
        for exchange in ("all_to_all", "all_gather", "fixed"):
            meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
            torch.manual_seed(0)
            model = parallelize_moe(MoE(make_config(COUNT_CASE)), meshes, sequence_parallel=False,
                                    exchange=exchange)  # fmt: skip
            torch.manual_seed(1 + self.rank)
            x = _input(meshes, LAYOUTS["ep4"], torch.randn(COUNT_CASE.B, COUNT_CASE.L, 16))
            _local_loss(model(x)).backward()
            with CommDebugMode() as fwd:
                y = model(x)
            with CommDebugMode() as bwd:
                _local_loss(y).backward()
            lines.append(f"{exchange}: forward {_counts(fwd)} | backward {_counts(bwd)}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
all_to_all: forward alltoall_base_=3 | backward alltoall_base_=2
all_gather: forward all_gather_into_tensor=3 reduce_scatter_tensor=1 | backward all_gather_into_tensor=1 reduce_scatter_tensor=1
fixed: forward alltoall_base_=3 | backward alltoall_base_=2""",  # noqa: E501
        )

    @with_comms
    def test_errors_that_need_a_mesh(self):
        """An unknown backend name given to ``parallelize_moe``, and the ``'local'`` backend
        on an expert-parallel mesh, raise on every rank."""
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        moe = MoE(make_config(COUNT_CASE))
        with self.assertRaisesRegex(
            ValueError,
            rf"parallelize_moe: unknown exchange 'all_gathr'; the registered backends are "
            rf"{_registered()} \(or pass a TokenExchange subclass\)",
        ):
            parallelize_moe(moe, meshes, sequence_parallel=False, exchange="all_gathr")
        with self.assertRaisesRegex(
            ValueError,
            r"the 'local' exchange sends no rows and takes no mesh, got DeviceMesh\(.*\); use "
            r"exchange='all_to_all' or 'all_gather' for expert parallelism",
        ):
            LocalExchange(num_experts=8, mesh=meshes.expert["ep"])


# -- the protocol's errors, in one process -------------------------------------------------------


def test_a_missing_declaration_is_a_type_error_naming_it():
    message = r"exchange backend \S*\.NoCapacity must declare " + re.escape(
        "['static_capacity'] as class attributes (Note [Exchange protocol] in "
        "dtensor_moe/routed/exchange.py)"
    )
    with pytest.raises(TypeError, match=message):

        class NoCapacity(TokenExchange):
            name = "no_capacity"
            hands_over_launches = True
            features = frozenset()

            def sort_and_send(self, *args):
                raise NotImplementedError

            def _combine(self, *args):
                raise NotImplementedError

            def reads_host_sizes(self, capacity=None):
                return False


def test_unknown_features_are_a_type_error():
    with pytest.raises(TypeError, match=r"exchange backend \S*\.Fancy declares " + re.escape(
        "unknown features ['deep_ep', 'fp8']; the known ones are ['expert_tp', 'own_rows', "
        "'pad_multiple', 'score_before_experts']"
    )):

        class Fancy(AllToAllExchange):
            name = "fancy"
            features = frozenset({"expert_tp", "fp8", "deep_ep"})


def test_a_second_class_under_a_registered_name_is_refused():
    before = exchange_names()

    class Impostor(AllGatherExchange):
        name = "all_gather"

    with pytest.raises(ValueError, match=re.escape(
        "an exchange named 'all_gather' is already registered (AllGatherExchange); give the "
        "new backend another name"
    )):
        register_exchange(Impostor)
    assert exchange_names() == before
    assert register_exchange(AllGatherExchange) is AllGatherExchange  # the same class: no-op
    with pytest.raises(TypeError, match=r"register_exchange takes a TokenExchange subclass, got "
                       r"<class 'int'>"):
        register_exchange(int)


@pytest.mark.parametrize("style", [ExpertParallel, ExpertTensorParallel])
def test_an_unknown_name_lists_the_registered_ones(style):
    assert {"all_gather", "all_to_all", "local"} <= set(exchange_names())
    with pytest.raises(ValueError, match=rf"{style.__name__}: unknown exchange 'nccl'; the "
                       rf"registered backends are {_registered()} \(or pass a TokenExchange "
                       r"subclass\)"):
        style(exchange="nccl")


def test_local_takes_no_mesh_and_all_gather_needs_one():
    assert LocalExchange(num_experts=4).mesh is None
    with pytest.raises(ValueError, match=r"the 'all_gather' exchange needs a mesh of the ranks "
                       r"that exchange rows; use exchange='local' when every expert is on this "
                       r"rank"):
        AllGatherExchange(num_experts=4)


def test_the_styles_refuse_the_local_exchange_and_parallelize_moe_checks_first():
    """``exchange='local'`` in an expert style, an unknown name with nothing to parallelize
    over, and ``pad_to_capacity`` with a backend without the static exchange: refused when the
    style or ``parallelize_moe`` is called, before any collective (one process, no mesh)."""
    for style in (ExpertParallel, ExpertTensorParallel):
        with pytest.raises(ValueError, match=re.escape(
            f"{style.__name__}(exchange='local'): the local exchange sends no rows"
        )):
            style(exchange="local")
    with pytest.raises(ValueError, match=r"unknown exchange 'all_gathr'; the registered"):
        parallelize_moe(MoE(make_config(COUNT_CASE)), None, sequence_parallel=False,
                        exchange="all_gathr")  # fmt: skip


def test_expert_tp_by_all_to_all_needs_the_feature():
    class NoExpertTP(AllToAllExchange):  # not registered: passed as a class
        name = "no_expert_tp"
        features = AllToAllExchange.features - {"expert_tp"}

    backend, shown = NoExpertTP, "no_expert_tp"
    with pytest.raises(ValueError, match=re.escape(
        f"ExpertTensorParallel(dispatch='all_to_all') sends each row to every hidden slice of "
        f"its expert, which the '{shown}' exchange does not support (no 'expert_tp' feature); "
        "use exchange='all_to_all', or dispatch='gather'"
    )):
        ExpertTensorParallel(dispatch="all_to_all", exchange=backend)
    ExpertTensorParallel(dispatch="gather", exchange=backend)  # gathered tokens: no exchange TP


def test_a_backend_built_with_a_feature_it_lacks_names_it():
    class NoPadding(LocalExchange):  # not registered
        name = "no_padding"
        features = LocalExchange.features - {"pad_multiple"}

    with pytest.raises(ValueError, match=re.escape(
        "the 'no_padding' exchange does not support pad_multiple (got replicas=1, "
        "pad_multiple=4, score_before_experts=False); use exchange='all_to_all', which "
        "supports every feature, or leave the setting at its default"
    )):
        NoPadding(num_experts=4, pad_multiple=4)
    assert NoPadding(num_experts=4).pad_multiple == 1


if __name__ == "__main__":
    run_tests()
