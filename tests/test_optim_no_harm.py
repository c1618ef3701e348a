"""``import dtensor_moe`` changes nothing the user didn't ask for (issue 13).

Each mode runs in its own fresh interpreter: one that never imports dtensor_moe, one that does
(fast paths on, the default), and one that does with ``DTENSOR_MOE_FAST_PATHS=0``. Each runs the
same grid of plain-tensor optimizer steps and one ``torch.compile`` of a step, and saves what it
got; the results must be identical (bit for bit) across modes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The grid. Options each optimizer supports on CPU in torch 2.13; left out, because torch itself
# rejects them on CPU whatever dtensor_moe does:
# * differentiable with fused ("`fused` does not support `differentiable`") and with foreach for
#   Adam/AdamW/Adagrad ("_foreach ops don't support autograd");
# * a tensor lr with foreach for Adam/AdamW ("lr as a Tensor is not supported for
#   capturable=False and foreach=True");
# * capturable except with fused Adam/AdamW (foreach/for-loop capturable need CUDA/XLA/HPU
#   params); SGD and Adagrad have no capturable and no amsgrad.
_SCRIPT = r'''
import os, sys
import torch
mode, out = sys.argv[1], sys.argv[2]
if mode != "torch":
    import dtensor_moe
    from dtensor_moe.optim import fast_paths_enabled
    assert fast_paths_enabled() == (mode == "import"), mode

OPTIONS = {
    "Adam": ("float_lr", "tensor_lr", "maximize", "differentiable", "capturable", "amsgrad"),
    "AdamW": ("float_lr", "tensor_lr", "maximize", "differentiable", "capturable", "amsgrad"),
    "SGD": ("float_lr", "tensor_lr", "maximize", "differentiable"),
    "Adagrad": ("float_lr", "tensor_lr", "maximize", "differentiable"),
}
SKIP = {
    ("fused", "differentiable"), ("foreach", "capturable"), ("forloop", "capturable"),
}


def skipped(cls, impl, opt):
    if (impl, opt) in SKIP:
        return True
    if impl == "foreach" and opt == "differentiable" and cls != "SGD":
        return True
    return impl == "foreach" and opt == "tensor_lr" and cls in ("Adam", "AdamW")


def run(cls, impl, opt):
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(5, 3, generator=gen, requires_grad=True) for _ in range(3)]
    kw = {"lr": torch.tensor(0.01) if opt == "tensor_lr" else 0.01}
    if opt != "float_lr" and opt != "tensor_lr":
        kw[opt] = True
    if cls == "SGD":
        kw["momentum"] = 0.9
    kw.update({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"})
    if opt == "differentiable":  # differentiable steps need non-leaf params
        params = [leaf.clone() for leaf in leaves]
    else:
        params = [torch.nn.Parameter(leaf.detach().clone()) for leaf in leaves]
    o = getattr(torch.optim, cls)(params, **kw)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * (i + 1)
        o.step()
    return [p.detach().clone() for p in params], o.state_dict()


grid = {}
for cls, opts in OPTIONS.items():
    for impl in ("fused", "foreach", "forloop"):
        for opt in opts:
            if not skipped(cls, impl, opt):
                grid[(cls, impl, opt)] = run(cls, impl, opt)

compiled = {}
import torch._dynamo
from torch._dynamo.utils import counters
for cls in ("AdamW", "SGD", "Adagrad"):
    for impl in ("forloop", "fused"):  # for-loop: torch.optim's default on CPU
        torch._dynamo.reset()
        counters.clear()
        params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
        for p in params:
            p.grad = torch.ones_like(p)
        impl_kw = {"fused": True} if impl == "fused" else {"foreach": False}
        o = getattr(torch.optim, cls)(params, lr=0.1, **impl_kw)

        def step():
            o.step()

        torch.compile(step, backend="eager")()
        compiled[(cls, impl)] = (
            counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()),
            counters["frames"]["total"],
        )

patched = None
if mode == "env0":  # the speed-only patches were never installed
    from dtensor_moe import _compat
    names = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    patched = {
        "entries": [getattr(torch, n) is not getattr(torch._C._VariableFunctions, n)
                    for n in names],
        "grouping": hasattr(torch.optim.Optimizer._group_tensors_by_device_and_dtype,
                            "__wrapped__"),
        "bodies": [hasattr(_compat.optimizer_step_body_cell(c).cell_contents,
                           "_dtensor_moe_fast_step")
                   for c in (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)],
        "handler": torch.ops.aten._fused_adam_.default in _compat.custom_op_handlers(),
    }
torch.save({"grid": grid, "compiled": compiled, "patched": patched}, out)
'''


def _run_modes(modes: tuple[str, ...], tmp: str) -> dict:
    """Run every mode in its own interpreter, all at once; return what each saved."""
    procs = {}
    for mode in modes:
        env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
        env.pop("DTENSOR_MOE_FAST_PATHS", None)
        if mode == "env0":
            env["DTENSOR_MOE_FAST_PATHS"] = "0"
        out = os.path.join(tmp, f"{mode}.pt")
        procs[mode] = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, mode, out], env=env, cwd=tmp,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    results = {}
    for mode, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"mode {mode} failed:\n{err[-3000:]}")
        results[mode] = torch.load(os.path.join(tmp, f"{mode}.pt"), weights_only=False)
    return results


class ImportDoesNoHarmTest(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with tempfile.TemporaryDirectory() as tmp:
            cls.results = _run_modes(("torch", "import", "env0"), tmp)

    def _assert_identical(self, a, b, where: str):
        if isinstance(a, torch.Tensor):
            self.assertIsInstance(b, torch.Tensor, where)
            self.assertEqual(a.dtype, b.dtype, msg=where)
            self.assertTrue(torch.equal(a, b), where)  # bit for bit (no nan in these steps)
        elif isinstance(a, dict):
            self.assertEqual(sorted(map(str, a)), sorted(map(str, b)), where)
            for k in a:
                self._assert_identical(a[k], b[k], f"{where}/{k}")
        elif isinstance(a, (list, tuple)):
            self.assertEqual(len(a), len(b), where)
            for i, (x, y) in enumerate(zip(a, b)):
                self._assert_identical(x, y, f"{where}[{i}]")
        else:
            self.assertEqual(a, b, msg=where)

    def test_plain_tensor_steps_are_bit_identical(self):
        want = self.results["torch"]["grid"]
        self.assertExpectedInline(str(len(want)), """47""")
        for mode in ("import", "env0"):
            got = self.results[mode]["grid"]
            self.assertEqual(sorted(got), sorted(want))
            for case in want:
                self._assert_identical(got[case], want[case], f"{mode} {case}")

    def test_compile_sees_the_same_graphs_breaks_and_frames(self):
        torch_counts = self.results["torch"]["compiled"]
        # (graphs, graph breaks, frames) without dtensor_moe: torch's own two breaks in
        # _use_grad_for_differentiable, and more where it disables dynamo for fused steps
        self.assertExpectedInline(
            str(torch_counts),
            """{('AdamW', 'forloop'): (1, 2, 10), ('AdamW', 'fused'): (0, 4, 14), ('SGD', 'forloop'): (1, 2, 10), ('SGD', 'fused'): (0, 3, 12), ('Adagrad', 'forloop'): (1, 2, 10), ('Adagrad', 'fused'): (0, 3, 12)}""",
        )
        self.assertEqual(self.results["env0"]["compiled"], torch_counts)
        # fused steps included: the fast body is armed by a pre-hook that does nothing while
        # compiling, so dynamo sees torch's own body (Note [Fast step])
        self.assertEqual(self.results["import"]["compiled"], torch_counts)

    def test_env_var_leaves_the_speed_only_patches_out(self):
        self.assertEqual(
            self.results["env0"]["patched"],
            {"entries": [False] * 4, "grouping": False, "bodies": [False] * 3, "handler": True},
        )


if __name__ == "__main__":
    run_tests()
