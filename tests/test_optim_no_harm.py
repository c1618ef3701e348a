"""``import dtensor_moe`` changes nothing the user didn't ask for.

Two fresh interpreters, one that never imports dtensor_moe and one that does, run the same grid
of plain-tensor optimizer steps and ``torch.compile`` of a step, and save what they got; the
results must be identical (bit for bit). A third interpreter lists every object in torch's
namespaces that ``import dtensor_moe`` replaces: only entries of DTensor's op-handler table may
change (docs/optimizers.md, "Everything the import changes").
"""

from __future__ import annotations

import ast
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

torch.save({"grid": grid, "compiled": compiled}, out)
'''


# Every object reachable by name from torch's namespaces that an optimizer step, GradScaler or
# DTensor dispatch goes through, before and after ``import dtensor_moe`` in one interpreter. The
# torch modules that dtensor_moe imports are imported first (argv[2:]), so that what they add
# themselves is not counted. The snapshots hold the objects themselves (compared with ``is``), so
# an object replaced and freed cannot pass for its successor. Replaced objects are listed by
# name; new names must be modules.
_QUIET_SCRIPT = r'''
import importlib, sys, types
import torch
import torch.optim.optimizer as optimizer_module
from torch.distributed.tensor import DTensor

for name in sys.argv[2:]:
    importlib.import_module(name)


def namespaces():
    classes = [c for c in vars(torch.optim).values()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)]
    spaces = {"torch": torch, "torch.Tensor": torch.Tensor,
              "torch.nn.Parameter": torch.nn.Parameter, "torch.nn.utils": torch.nn.utils,
              "torch.amp": torch.amp, "torch.amp.GradScaler": torch.amp.GradScaler,
              "DTensor": DTensor,
              "torch.distributed.tensor": sys.modules["torch.distributed.tensor"],
              "torch.utils._foreach_utils": sys.modules["torch.utils._foreach_utils"]}
    for cls in classes:
        spaces[f"class {cls.__name__}"] = cls
        spaces[f"module {cls.__module__}"] = sys.modules[cls.__module__]
    return spaces, classes


def closures(fn, where, out):
    """The contents of every closure cell along ``fn``'s chain of ``__wrapped__``."""
    seen = 0
    while fn is not None and seen < 10:
        for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()),
                              getattr(fn, "__closure__", None) or ()):
            out[(where, f"cell {seen}:{name}")] = cell.cell_contents
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1


def snapshot():
    spaces, classes = namespaces()
    snap = {}
    for where, space in spaces.items():
        for name, value in vars(space).items():
            snap[(where, name)] = value
    for cls in classes:
        closures(cls.step, f"{cls.__name__}.step", snap)
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        for key, hook in getattr(optimizer_module, name).items():
            snap[(name, key)] = hook
    dispatcher = DTensor._op_dispatcher
    for op, handler in dispatcher._custom_op_handlers.items():
        snap[("custom_op_handlers", str(op))] = handler
    propagator = dispatcher.sharding_propagator
    for table in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs"):
        for op, fn in getattr(propagator, table, {}).items():
            snap[(table, str(op))] = fn
    return snap


before = snapshot()
import dtensor_moe  # noqa: E402
after = snapshot()
spaces, _ = namespaces()


def is_submodule(where, name):
    return where in spaces and isinstance(vars(spaces[where]).get(name), types.ModuleType)


changed = sorted(f"{w}: {n}" for (w, n), v in before.items()
                 if (w, n) in after and after[(w, n)] is not v)
removed = sorted(f"{w}: {n}" for (w, n) in before if (w, n) not in after)
added = sorted(f"{w}: {n}" for (w, n) in after if (w, n) not in before and not is_submodule(w, n))
print(repr({"changed": changed, "removed": removed, "added": added}))
'''


def _torch_modules_dtensor_moe_imports() -> list[str]:
    """Names of the torch modules that ``import dtensor_moe`` imports (in a fresh interpreter)."""
    code = ("import sys; before = set(sys.modules); import dtensor_moe; "
            "print(' '.join(sorted(m for m in set(sys.modules) - before "
            "if m.split('.')[0] == 'torch')))")
    env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.split()


def _run_modes(modes: tuple[str, ...], tmp: str) -> dict:
    """Run every mode in its own interpreter, all at once; return what each saved."""
    procs = {}
    for mode in modes:
        env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
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
            cls.results = _run_modes(("torch", "import"), tmp)

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
        got = self.results["import"]["grid"]
        self.assertEqual(sorted(got), sorted(want))
        for case in want:
            self._assert_identical(got[case], want[case], f"import {case}")

    def test_compile_sees_the_same_graphs_breaks_and_frames(self):
        torch_counts = self.results["torch"]["compiled"]
        # (graphs, graph breaks, frames) without dtensor_moe: torch's own two breaks in
        # _use_grad_for_differentiable, and more where it disables dynamo for fused steps
        self.assertExpectedInline(
            str(torch_counts),
            """{('AdamW', 'forloop'): (1, 2, 10), ('AdamW', 'fused'): (0, 4, 14), ('SGD', 'forloop'): (1, 2, 10), ('SGD', 'fused'): (0, 3, 12), ('Adagrad', 'forloop'): (1, 2, 10), ('Adagrad', 'fused'): (0, 3, 12)}""",
        )
        self.assertEqual(self.results["import"]["compiled"], torch_counts)


class QuietImportTest(TestCase):
    def test_import_changes_only_dtensor_op_handlers(self):
        env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", _QUIET_SCRIPT, "quiet", *_torch_modules_dtensor_moe_imports()],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        diff = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
        from dtensor_moe.optim.fused import FUSED_OPS

        handled = sorted(f"custom_op_handlers: {op}" for op in FUSED_OPS)
        # torch 2.13 has a handler of its own for the inf check only; the 24 fused overloads
        # are new entries of the table (torch's sharding rules for fused Adam/AdamW stay in
        # place, unused once the handler answers first)
        self.assertEqual(diff["changed"], [
            "custom_op_handlers: aten._amp_foreach_non_finite_check_and_unscale_.default"
        ])
        self.assertEqual(diff["removed"], [])
        self.assertEqual(diff["added"], handled)


if __name__ == "__main__":
    run_tests()
