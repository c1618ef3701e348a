"""The auxiliary loss follows the loss (Note [Auxiliary loss follows the loss]).

Every case compares the layer, with its loss collected by ``collect_aux_losses()`` and added to
the user's loss, against ``loss + aux`` computed by the naive reference of
``tests/test_moe_layer.py`` (a loop over tokens that recomputes the aux-loss formula from the
router scores; it does not call the code under test): GradScaler at 65536, ``loss / n`` over
micro-batches, ``loss * 0``, a second backward through the output, activation checkpointing,
``torch.compile``, and 4 gloo ranks under EP4. The gate, expert and input gradients are
compared. The automatic ``"attach"`` route is pinned too, with the defects that it documents.

Shape legend: B sequences, L tokens per sequence, D dim.
"""

# ruff: noqa: N806

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms
from torch.utils.checkpoint import checkpoint

from dtensor_moe.moe import MoE, MoEConfig
from dtensor_moe.moe.balance import AuxLosses, attach_aux_loss, collect_aux_losses
from tests._dist import DistTestBase
from tests.test_moe_layer import D, close, make_moe, reference_moe

SCALE = 65536.0
COEFF = 0.5  # large enough that the aux part of the gate gradient is far above fp32 rounding


def make(mode: str = "collect", **overrides) -> MoE:
    fields = dict(aux_loss_coeff=COEFF, num_shared_experts=1, aux_loss_mode=mode)
    fields.update(overrides)
    return make_moe(**fields)


def data(seed: int, shape=(2, 7, D)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def forward(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, aux total)`` of one collected forward; ``x`` is a fresh leaf."""
    x = x.detach().clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = moe(x)
    return x, y, aux.total()


def reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y, aux = reference_moe(moe, x)
    return x, y, aux


def grads(moe: MoE, xs) -> dict[str, torch.Tensor]:
    out = {f"x{i}.grad": x.grad for i, x in enumerate(xs)}
    for name, p in moe.named_parameters():
        out[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out


def assert_same_grads(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        close(actual[name], grad, msg=f"{what}: {name}")


def aux_part_of_gate_grad(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``d(aux)/d(gate)`` of the reference alone (the loss is the aux loss)."""
    ref = copy.deepcopy(moe)
    _, _, aux = reference(ref, x)
    aux.backward()
    return ref.router.gate.weight.grad


# -- the collected loss against loss + aux ---------------------------------------------------


def test_grad_scaler_65536():
    """``scaler.scale(loss).backward()`` then ``unscale_``: the grads of ``loss + aux``."""
    moe = make()
    ref = copy.deepcopy(moe)
    X, G = data(0)
    x, y, aux = forward(moe, X)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    scaler.scale((y * G).sum() + aux).backward()
    scaler.unscale_(opt)
    x.grad /= SCALE  # x is no optimizer param: unscale it by hand
    x_ref, y_ref, aux_ref = reference(ref, X)
    ((y_ref * G).sum() + aux_ref).backward()
    close(aux.detach(), aux_ref.detach(), "aux value")
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "GradScaler")


@pytest.mark.parametrize("n_micro", [1, 3])
def test_loss_divided_by_micro_batches(n_micro):
    """Gradient accumulation of ``(loss_m + aux_m) / n`` over ``n`` micro-batches."""
    moe = make()
    ref = copy.deepcopy(moe)
    xs, xs_ref = [], []
    for m in range(n_micro):
        X, G = data(10 + m, shape=(1 + m % 2, 5 + m, D))
        x, y, aux = forward(moe, X)
        (((y * G).sum() + aux) / n_micro).backward()
        x_ref, y_ref, aux_ref = reference(ref, X)
        (((y_ref * G).sum() + aux_ref) / n_micro).backward()
        xs.append(x)
        xs_ref.append(x_ref)
    assert_same_grads(grads(moe, xs), grads(ref, xs_ref), f"loss / {n_micro}")


def test_loss_times_zero_trains_nothing():
    moe = make()
    X, G = data(1)
    x, y, aux = forward(moe, X)
    (((y * G).sum() + aux) * 0).backward()
    assert float(aux.detach()) > 0
    for name, grad in grads(moe, [x]).items():
        assert grad.abs().max() == 0, name


def test_second_backward_through_output():
    """The aux loss is in the first loss only; a second backward through ``y`` adds none."""
    moe = make()
    ref = copy.deepcopy(moe)
    X, G = data(2)
    G2 = torch.randn(X.shape, generator=torch.Generator().manual_seed(7))
    x, y, aux = forward(moe, X)
    ((y * G).sum() + aux).backward(retain_graph=True)
    (y * G2).sum().backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    ((y_ref * G).sum() + aux_ref).backward(retain_graph=True)
    (y_ref * G2).sum().backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "second backward")


def test_two_micro_batches_in_flight_and_nested_collectors():
    moe = make()
    ref = copy.deepcopy(moe)
    X1, G1 = data(3)
    X2, G2 = data(4, shape=(1, 9, D))
    x1 = X1.clone().requires_grad_()
    x2 = X2.clone().requires_grad_()
    with collect_aux_losses() as outer:
        y1 = moe(x1)
        with collect_aux_losses() as inner:
            y2 = moe(x2)
    assert (len(outer), len(inner)) == (1, 1)
    ((y1 * G1).sum() + outer.total() + 2 * ((y2 * G2).sum() + inner.total())).backward()
    x1_ref, y1_ref, aux1 = reference(ref, X1)
    x2_ref, y2_ref, aux2 = reference(ref, X2)
    ((y1_ref * G1).sum() + aux1 + 2 * ((y2_ref * G2).sum() + aux2)).backward()
    assert_same_grads(grads(moe, [x1, x2]), grads(ref, [x1_ref, x2_ref]), "in flight")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpoint_backward_inside_block(use_reentrant):
    """The recompute runs inside the open collector and adds nothing to it; grads unchanged.

    Under reentrant checkpointing the first forward runs without grad, so nothing is collected
    and the recompute attaches the loss (weight 1): exact for this unscaled loss only.
    """
    moe = make(use_expert_bias=True)
    ref = copy.deepcopy(moe)
    X, G = data(5)
    x = X.clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = checkpoint(moe, x, use_reentrant=use_reentrant)
        ((y * G).sum() + aux.total()).backward()
    assert len(aux) == (0 if use_reentrant else 1)
    x_ref, y_ref, aux_ref = reference(ref, X)
    ((y_ref * G).sum() + aux_ref).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "checkpoint")


def test_non_reentrant_checkpoint_under_grad_scaler():
    moe = make()
    ref = copy.deepcopy(moe)
    X, G = data(6)
    x = X.clone().requires_grad_()
    with collect_aux_losses() as aux:
        y = checkpoint(moe, x, use_reentrant=False)
    (((y * G).sum() + aux.total()) * SCALE).backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) * SCALE).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "checkpoint, scaled")


def test_collector_api():
    moe = make()
    with collect_aux_losses() as aux:
        assert isinstance(aux, AuxLosses) and len(aux) == 0
        assert float(aux.total()) == 0.0
        moe(torch.randn(2, 3, D))
        moe(torch.randn(1, 4, D))
    assert len(aux.losses) == 2 and repr(aux) == "AuxLosses(n=2)"
    close(aux.total().detach(), sum(aux.losses).detach())
    assert aux.total().requires_grad
    moe.eval()  # no aux loss in eval mode, and no error without a collector
    moe(torch.randn(2, 3, D))
    moe.train()
    with torch.no_grad():  # a loss without grad goes nowhere: no error either
        moe(torch.randn(2, 3, D))


def test_missing_collector_raises():
    moe = make()
    match = r"outside collect_aux_losses\(\).*aux_loss_mode='attach'"
    with pytest.raises(ValueError, match=match):
        moe(torch.randn(2, 3, D))
    make(aux_loss_coeff=0.0)(torch.randn(2, 3, D))  # no aux loss: nothing to collect


def test_bad_mode_raises():
    with pytest.raises(ValueError, match=r"aux_loss_mode='auto' is not one of"):
        MoEConfig(dim=D, hidden_dim=8, num_experts=4, top_k=1, aux_loss_mode="auto")


# -- the automatic route: exact for one unscaled backward, and only then ----------------------


def test_attach_mode_exact_for_one_unscaled_backward():
    moe = make("attach")
    ref = copy.deepcopy(moe)
    X, G = data(8)
    x = X.clone().requires_grad_()
    (moe(x) * G).sum().backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    ((y_ref * G).sum() + aux_ref).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "attach")


@pytest.mark.parametrize("factor", [1 / SCALE, 3.0, 0.0])
def test_attach_mode_ignores_what_is_done_to_the_loss(factor):
    """The documented defect: ``(factor * loss).backward()`` gives the main part ``factor`` and
    the aux part weight 1 (GradScaler: unscaling leaves 1/S of it; ``loss / n``: n times too
    strong; ``loss * 0``: the router still trains)."""
    moe = make("attach")
    ref = copy.deepcopy(moe)
    X, G = data(9)
    ((moe(X) * G).sum() * factor).backward()
    _, y_ref, _ = reference(ref, X)
    ((y_ref * G).sum() * factor).backward()
    total = moe.router.gate.weight.grad
    aux_part = total - ref.router.gate.weight.grad  # a difference: fp32 rounding of the total
    atol = 1e-5 * float(total.abs().max())
    torch.testing.assert_close(aux_part, aux_part_of_gate_grad(moe, X), rtol=1e-5, atol=atol)


def test_collector_takes_the_loss_in_attach_mode():
    moe = make("attach")
    ref = copy.deepcopy(moe)
    X, G = data(11)
    x, y, aux = forward(moe, X)
    (((y * G).sum() + aux) / 4).backward()
    x_ref, y_ref, aux_ref = reference(ref, X)
    (((y_ref * G).sum() + aux_ref) / 4).backward()
    assert_same_grads(grads(moe, [x]), grads(ref, [x_ref]), "attach mode, collected")


def test_attach_aux_loss_default_mode_is_attach():
    """Callers that pass no mode (the token-parallel forward) keep the automatic route."""
    y = torch.randn(3, requires_grad=True)
    aux = torch.tensor(2.0, requires_grad=True)
    (attach_aux_loss(y, aux) * 0).sum().backward()
    assert float(aux.grad) == 1.0 and float(y.grad.abs().sum()) == 0.0
    with collect_aux_losses() as collected:
        assert attach_aux_loss(y, aux) is y
    assert collected.losses == (aux,)
    with pytest.raises(ValueError, match=r"mode='auto' is not 'collect' or 'attach'"):
        attach_aux_loss(y, aux, mode="auto")


# -- torch.compile --------------------------------------------------------------------------


def test_compiled_collect_matches_eager_without_new_breaks_or_recompiles():
    moe = make()
    eager = copy.deepcopy(moe)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(moe, backend="aot_eager")
    for step in range(3):  # a new collector each step: no recompile
        X, G = data(20 + step)
        x, y, aux = forward(compiled, X)
        (((y * G).sum() + aux) * SCALE).backward()
        x_e, y_e, aux_e = forward(eager, X)
        (((y_e * G).sum() + aux_e) * SCALE).backward()
        close(aux.detach(), aux_e.detach(), f"step {step}: aux")
        got = {n.replace("_orig_mod.", ""): g for n, g in grads(compiled, [x]).items()}
        assert_same_grads(got, grads(eager, [x_e]), f"compiled step {step}")
        compiled.zero_grad()
        eager.zero_grad()
    # the one training break of Note [MoE under torch.compile] (the token counter), no more
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    with pytest.raises(ValueError, match=r"outside collect_aux_losses"):
        compiled(torch.randn(2, 7, D))
    torch._dynamo.reset()


# -- 4 ranks, EP4 (dp2ep) ---------------------------------------------------------------------


class AuxLossEP4Test(DistTestBase):
    @with_comms
    def test_ep4_grad_scaler_and_micro_batches(self):
        """Each rank: 2 micro-batches of its data shard, ``scaler.scale((loss + aux) / 2)``,
        the default ``"collect"`` mode. The reduced grads equal the reference's grads of
        ``mean over shards of sum over micro-batches (loss + aux) / 2``, unscaled."""
        from dtensor_moe.parallel import build_moe_meshes, parallelize_moe
        from tests.test_parallel_moe import as_param_grad, full, reduce_grad

        n_micro, B, L = 2, 2, 5
        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        ref = make(use_expert_bias=True)
        model = parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False)
        gen = torch.Generator().manual_seed(0)
        X = torch.randn(meshes.dp, n_micro, B, L, D, generator=gen)
        G = torch.randn(meshes.dp, n_micro, B, L, D, generator=gen)
        d = self.rank
        x_grads = []
        for m in range(n_micro):
            x, y, aux = forward(model, X[d, m])
            (((y * G[d, m]).sum() + aux) / n_micro * SCALE).backward()
            x_grads.append(x.grad / SCALE)
        ref_x_grads = {}
        for shard, m in ((s, m) for s in range(meshes.dp) for m in range(n_micro)):
            x_ref, y_ref, aux_ref = reference(ref, X[shard, m])
            (((y_ref * G[shard, m]).sum() + aux_ref) / n_micro / meshes.dp).backward()
            ref_x_grads[shard, m] = x_ref.grad * meshes.dp  # a rank's loss is not / dp
        for m in range(n_micro):
            close(x_grads[m], ref_x_grads[d, m], f"rank {d} micro {m}: x.grad")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            param.grad = param.grad / SCALE
            grad = as_param_grad(param, reduce_grad(name, param, meshes))
            close(full(grad), ref_params[name].grad, f"rank {d}: {name}.grad")

    @with_comms
    def test_ep4_second_backward_through_output(self):
        """As in one process (test_second_backward_through_output), under EP4: the aux loss is
        in the first loss only; a second backward through ``y`` (``retain_graph``) adds none.
        Each backward runs the exchange's backward on every rank."""
        from dtensor_moe.parallel import build_moe_meshes, parallelize_moe
        from tests.test_parallel_moe import as_param_grad, full, reduce_grad

        meshes = build_moe_meshes(dp=4, ep=4, device_type="cpu")
        ref = make()
        model = parallelize_moe(copy.deepcopy(ref), meshes, sequence_parallel=False)
        gen = torch.Generator().manual_seed(3)
        X = torch.randn(meshes.dp, 2, 5, D, generator=gen)
        G = torch.randn(meshes.dp, 2, 5, D, generator=gen)
        G2 = torch.randn(meshes.dp, 2, 5, D, generator=gen)
        d = self.rank
        x, y, aux = forward(model, X[d])
        ((y * G[d]).sum() + aux).backward(retain_graph=True)
        (y * G2[d]).sum().backward()
        for shard in range(meshes.dp):
            x_ref, y_ref, aux_ref = reference(ref, X[shard])
            (((y_ref * G[shard]).sum() + aux_ref) / meshes.dp).backward(retain_graph=True)
            ((y_ref * G2[shard]).sum() / meshes.dp).backward()
            if shard == d:
                close(x.grad, x_ref.grad * meshes.dp, f"rank {d}: x.grad")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = as_param_grad(param, reduce_grad(name, param, meshes))
            close(full(grad), ref_params[name].grad, f"rank {d}: {name}.grad")

    @with_comms
    def test_token_parallel_forward_follows_the_mode(self):
        """Under SP2 + EP2 (PrepareMoEInput) the layer honours ``aux_loss_mode`` as in one
        process: the default raises without a collector, a collector takes each rank's
        share, and ``"attach"`` attaches it."""
        from torch.distributed.tensor import Shard, distribute_tensor

        from dtensor_moe import collect_aux_losses
        from dtensor_moe.parallel import build_moe_meshes, parallelize_moe

        meshes = build_moe_meshes(dp=2, ep=2, tp=2, device_type="cpu")
        tp = meshes.dense["tp"]
        x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(self.rank // 2))
        x = distribute_tensor(x, tp, [Shard(1)])
        model = parallelize_moe(make(), meshes, sequence_parallel=True)
        with self.assertRaisesRegex(ValueError, r"outside collect_aux_losses\(\)"):
            model(x)
        with collect_aux_losses() as aux:
            y = model(x)
        self.assertEqual(len(aux.losses), 1)
        (y.to_local() * 0).sum().backward()  # collected, not added: the router gets nothing
        self.assertEqual(model.router.gate.weight.grad.to_local().abs().max().item(), 0.0)
        attach = parallelize_moe(make(aux_loss_mode="attach"), meshes, sequence_parallel=True)
        (attach(x).to_local() * 0).sum().backward()  # attached: weight 1 whatever the loss
        self.assertGreater(attach.router.gate.weight.grad.to_local().abs().max().item(), 0.0)


if __name__ == "__main__":
    run_tests()
