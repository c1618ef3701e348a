"""The dense tensor-parallel plan (``dtensor_moe.parallel.dense``): the snippet of
``docs/training.md`` section 2, run as written on 4 gloo ranks with sequence parallelism on and
off, matches the same model on one process; wrong names raise before anything is sharded.

The tiny model of ``tests/_moe_model.py`` goes through the same function with its own
``DenseNames`` in every tensor-parallel layout of ``tests/test_fsdp_moe.py`` and
``tests/test_checkpoint_moe.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import with_comms

from dtensor_moe import MoEConfig
from dtensor_moe.demo.model import ModelConfig, MoETransformer
from dtensor_moe.parallel import DenseNames, dense_tp_plan
from tests._dist import DistTestBase
from tests._moe_model import DENSE_NAMES, make_model

TRAINING_MD = Path(__file__).resolve().parent.parent / "docs" / "training.md"
RTOL, ATOL = 1e-5, 1e-6


def documented_snippet() -> str:
    """The python block of ``docs/training.md`` that calls ``parallelize_dense``."""
    blocks = re.findall(r"```python\n(.*?)```", TRAINING_MD.read_text(), re.S)
    found = [b for b in blocks if "parallelize_dense(model" in b and "sp = True" in b]
    assert len(found) == 1, f"expected one runnable dense-plan snippet, found {len(found)}"
    return found[0]


class DocumentedDensePlanTest(DistTestBase):
    @with_comms
    def test_training_md_snippet_matches_one_process(self):
        source = documented_snippet()
        for sp in (True, False):
            namespace: dict = {}
            code = source.replace("sp = True", f"sp = {sp}", 1)
            # the test harness makes and destroys the process group
            with mock.patch.object(dist, "init_process_group"), \
                    mock.patch.object(dist, "destroy_process_group"):
                exec(compile(code, f"{TRAINING_MD}:dense-plan", "exec"), namespace)
            self._check_against_one_process(namespace, f"sequence_parallel={sp}")

    def _check_against_one_process(self, ns: dict, where: str) -> None:
        model, meshes, tokens, loss = ns["model"], ns["meshes"], ns["tokens"], ns["loss"]
        dp_group = meshes.dense["dp"].get_group()
        shards = [torch.empty_like(tokens) for _ in range(meshes.dp)]
        dist.all_gather(shards, tokens, group=dp_group)
        torch.manual_seed(0)  # the snippet's seed; the weights are compared first
        ref = MoETransformer(model.config)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            torch.testing.assert_close(full, ref_params[name], rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{where}: initial {n}: {m}")
        ref_losses = [F.cross_entropy(ref(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
                      for t in shards]
        torch.stack(ref_losses).mean().backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG, group=dp_group)
        torch.testing.assert_close(mean_loss, torch.stack(ref_losses).mean().detach(),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: loss: {m}")
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, ref_params[name].grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{where}: {n}.grad: {m}")


def _demo_model(n_layers: int = 2) -> MoETransformer:
    moe = MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2)
    return MoETransformer(ModelConfig(vocab_size=32, dim=16, n_layers=n_layers, n_heads=2,
                                      moe=moe))


def _describe(plan: dict) -> dict[str, str]:
    def fmt(style) -> str:
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            return (f"{type(style).__name__}(in={style.input_layouts[0]!r}, "
                    f"out={style.output_layouts[0]!r}, local={style.use_local_output})")
        if isinstance(style, PrepareModuleInput):
            return (f"PrepareModuleInput({style.input_layouts!r} -> "
                    f"{style.desired_input_layouts!r})")
        return type(style).__name__

    return {name: fmt(style) for name, style in plan.items()}


def test_plan_for_the_demo_model_with_and_without_sp():
    """The defaults name the demo model; under SP the residual stream stays a Shard(1) DTensor
    (use_local_output=False on the embedding and the attention output), without it plain."""
    model = _demo_model(n_layers=1)
    sp = _describe(dense_tp_plan(model, sequence_parallel=True))
    assert sp == {
        "tok_embeddings": "RowwiseParallel(in=Replicate(), out=Shard(dim=1), local=False)",
        "layers.0.attention": "PrepareModuleInput((Shard(dim=1),) -> (Replicate(),))",
        "layers.0.attention.wq": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wk": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wv": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wo": "RowwiseParallel(in=Shard(dim=-1), out=Shard(dim=1), local=False)",
        "layers.0.attention_norm": "SequenceParallel",
        "layers.0.moe_norm": "SequenceParallel",
        "norm": "SequenceParallel",
        "output": "ColwiseParallel(in=Shard(dim=1), out=Replicate(), local=True)",
    }
    plain = _describe(dense_tp_plan(model, sequence_parallel=False))
    assert plain == {
        "tok_embeddings": "RowwiseParallel(in=Replicate(), out=Replicate(), local=True)",
        "layers.0.attention.wq": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wk": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wv": "ColwiseParallel(in=Replicate(), out=Shard(dim=-1), local=True)",
        "layers.0.attention.wo": "RowwiseParallel(in=Shard(dim=-1), out=Replicate(), local=True)",
        "output": "ColwiseParallel(in=Replicate(), out=Replicate(), local=True)",
    }


def test_nothing_gathered_means_each_colwise_gathers_its_input():
    plan = dense_tp_plan(make_model(), sequence_parallel=True, names=DENSE_NAMES)
    assert isinstance(plan["layers.1.up"], ColwiseParallel)
    assert plan["layers.1.up"].input_layouts == (Shard(1),)
    assert plan["layers.1.down"].output_layouts == (Shard(1),)
    assert not plan["layers.1.down"].use_local_output
    assert plan["embed"].output_layouts == (Shard(1),)
    assert not any(isinstance(s, PrepareModuleInput) for s in plan.values())
    plain = dense_tp_plan(make_model(), sequence_parallel=False, names=DENSE_NAMES)
    assert plain["layers.1.up"].input_layouts == (Replicate(),)
    assert not any(isinstance(s, SequenceParallel) for s in plain.values())


@pytest.mark.parametrize(
    ("names", "error", "message"),
    [
        (DenseNames(embedding="embed"), ValueError,
         r"dense_tp_plan: MoETransformer has no module 'embed' \(DenseNames\.embedding\); the "
         r"children there are \['tok_embeddings', 'layers', 'norm', 'output'\]\. Pass "
         r"names=DenseNames\(embedding=\.\.\.\) with your model's name, or None"),
        (DenseNames(colwise=("attention.q_proj",)), ValueError,
         r"no module 'layers\.0\.attention\.q_proj' \(DenseNames\.colwise\); the children "
         r"there are \['wq', 'wk', 'wv', 'wo'\]"),
        (DenseNames(layers="blocks"), ValueError, r"no module 'blocks' \(DenseNames\.layers\)"),
        (DenseNames(rowwise=("attention",)), TypeError,
         r"'layers\.0\.attention' \(DenseNames\.rowwise\) is of type Attention, but torch's "
         r"tensor-parallel styles shard only Linear"),
        (DenseNames(output="norm"), TypeError,
         r"'norm' \(DenseNames\.output\) is of type RMSNorm, but .* shard only Linear"),
    ],
)
def test_wrong_names_raise_before_anything_is_sharded(names, error, message):
    model = _demo_model()
    with pytest.raises(error, match=message):
        dense_tp_plan(model, sequence_parallel=True, names=names)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_names_must_be_tuples_and_a_dense_names():
    with pytest.raises(TypeError, match=r"DenseNames\.colwise must be a tuple of module names, "
                                        r"got 'attention\.wq'; for one name write"):
        DenseNames(colwise="attention.wq")
    with pytest.raises(TypeError, match="names must be a DenseNames, got dict"):
        dense_tp_plan(_demo_model(), sequence_parallel=False, names={"embedding": "x"})


def test_parallelize_dense_needs_a_1d_mesh():
    from dtensor_moe.parallel import parallelize_dense

    with pytest.raises(ValueError, match=r"needs the 1-D tensor-parallel mesh .*got None"):
        parallelize_dense(nn.Linear(2, 2), None, sequence_parallel=False)


if __name__ == "__main__":
    run_tests()
