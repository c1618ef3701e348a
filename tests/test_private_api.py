"""Private torch names appear only in ``dtensor_moe/_compat.py`` and on its allowlist.

The allowlist is Note [Private torch names outside _compat] in ``dtensor_moe/_compat.py`` (its
module docstring), parsed here so that there is one source of truth. Every module of the package
is scanned with ``ast``; the scanner itself is tested on snippets of every form it must catch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dtensor_moe
from dtensor_moe import _compat

PACKAGE = Path(dtensor_moe.__file__).resolve().parent
ROOT = PACKAGE.parent
COMPAT = "dtensor_moe/_compat.py"
_ENTRY = re.compile(r"^    (dtensor_moe/[\w/]+\.py): (torch(?:\.\w+)+)(?: --.*)?$", re.MULTILINE)


def allowlist() -> dict[str, set[str]]:
    """``{module path: allowed private names}`` from ``_compat``'s module docstring."""
    allowed: dict[str, set[str]] = {}
    for module, name in _ENTRY.findall(_compat.__doc__ or ""):
        allowed.setdefault(module, set()).add(name)
    return allowed


def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _chain(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The dotted torch name of ``a.b.c`` when its root name is bound to a torch object."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch objects: imports, then plain ``x = torch...`` assignments."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "torch":
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for _ in range(3):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], _chain(node.value, aliases)
                if isinstance(target, ast.Name) and value is not None:
                    aliases.setdefault(target.id, value)
    return aliases


def private_names(source: str) -> set[str]:
    """Every torch name with a private segment that ``source`` imports or reads."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_chain(node, aliases) or ""]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                base, attr = _chain(node.args[0], aliases), node.args[1]
                if base is not None and isinstance(attr, ast.Constant):
                    names = [f"{base}.{attr.value}"]
        found.update(
            n for n in names if n.split(".")[0] == "torch" and any(map(_is_private, n.split(".")))
        )
    # keep the longest chains: ``torch._x.y`` already says ``torch._x`` is used
    return {n for n in found if not any(o.startswith(n + ".") for o in found)}


def _allowed(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def _modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))


def test_allowlist_is_parsed():
    allowed = allowlist()
    assert allowed, "Note [Private torch names outside _compat] lists no entry"
    for module in allowed:
        assert module != COMPAT and (ROOT / module).is_file(), f"allowlist names {module}"


def test_only_allowed_private_torch_names_outside_compat():
    allowed = allowlist()
    offending, used = {}, {}
    for module in _modules():
        if module == COMPAT:
            continue
        names = private_names((ROOT / module).read_text())
        bad = sorted(n for n in names if not _allowed(n, allowed.get(module, set())))
        if bad:
            offending[module] = bad
        used[module] = names
    assert not offending, (
        f"private torch names outside dtensor_moe/_compat.py: {offending}; add a helper to "
        "_compat.py, or list the name under Note [Private torch names outside _compat] there"
    )
    stale = {
        m: sorted(a for a in names if not any(_allowed(u, {a}) for u in used.get(m, ())))
        for m, names in allowed.items()
    }
    stale = {m: names for m, names in stale.items() if names}
    assert not stale, f"allowlisted names that their module no longer uses: {stale}"


@pytest.mark.parametrize(
    "source,expected",
    [
        ("import torch\ntorch._grouped_mm(a, b)", {"torch._grouped_mm"}),
        ("import torch\nx: torch._ops.OpOverload", {"torch._ops.OpOverload"}),
        ("from torch._ops import OpOverload", {"torch._ops.OpOverload"}),
        ("from torch.distributed.tensor import _utils", {"torch.distributed.tensor._utils"}),
        ("import torch.distributed._sharded", {"torch.distributed._sharded"}),
        (
            "import torch.distributed._functional_collectives as funcol\nfuncol.all_reduce(t)",
            {"torch.distributed._functional_collectives.all_reduce"},
        ),
        (
            "from torch.distributed.tensor import DTensor\nDTensor._op_dispatcher.x",
            {"torch.distributed.tensor.DTensor._op_dispatcher.x"},
        ),
        ("import torch\naten = torch.ops.aten\naten._foo.default", {"torch.ops.aten._foo.default"}),
        ("import torch as th\nth._C._get_x()", {"torch._C._get_x"}),
        ("import torch\ngetattr(torch, '_fused_adam_')", {"torch._fused_adam_"}),
        ("import torch\ntorch.nn.functional.silu(x)\ntorch.__version__", set()),
        ("import torch\nself._x = torch.zeros(1)\nmoe._check_input(x)", set()),
        ("from dtensor_moe import _compat\n_compat.local_tensor(x)", set()),
    ],
)
def test_scanner_catches_every_form(source, expected):
    assert private_names(source) == expected
