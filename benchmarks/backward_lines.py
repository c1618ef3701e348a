"""Count the lines of the package that compute gradients by hand.

Counted: the ``backward`` method of every ``torch.autograd.Function`` subclass in the package,
every function given to ``register_autograd``, and the package functions they call
(transitively), each once. Lines are source lines of the function body that are not blank,
comments or the docstring. Run::

    python benchmarks/backward_lines.py            # the installed dtensor_moe
    python benchmarks/backward_lines.py --list     # with each function's count
"""

from __future__ import annotations

import argparse
import ast
import pathlib

import dtensor_moe


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions and the methods of classes, by name (methods as ``Cls.name``)."""
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _is_function(base: ast.expr, functions: set[str]) -> bool:
    """``torch.autograd.Function`` itself, or a subclass of it defined in the same module."""
    if isinstance(base, ast.Attribute):
        return base.attr == "Function"
    return isinstance(base, ast.Name) and base.id in functions


def _roots(tree: ast.Module) -> list[str]:
    roots = []
    functions: set[str] = set()  # this module's Function subclasses, bases before their users
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(_is_function(b, functions) for b in node.bases):
            functions.add(node.name)
            roots += [f"{node.name}.backward"] if any(
                isinstance(i, ast.FunctionDef) and i.name == "backward" for i in node.body
            ) else []
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "register_autograd"
                and call.args
                and isinstance(call.args[0], ast.Name)
            ):
                roots.append(call.args[0].id)
    return roots


def _body_lines(fn: ast.FunctionDef, source: list[str]) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    lines = source[body[0].lineno - 1 : fn.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def count(package_dir: pathlib.Path) -> dict[str, int]:
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        modules[path] = (tree, _functions(tree), text.splitlines())
    everywhere: dict[str, tuple[pathlib.Path, ast.FunctionDef]] = {}
    for path, (_, fns, _) in modules.items():
        for name, fn in fns.items():
            everywhere.setdefault(name, (path, fn))
    todo = [(path, name) for path, (tree, _, _) in modules.items() for name in _roots(tree)]
    seen: dict[str, int] = {}
    while todo:
        path, name = todo.pop()
        fns = modules[path][1]
        hit = (path, fns[name]) if name in fns else everywhere.get(name)
        if hit is None:
            continue
        key = f"{hit[0].relative_to(package_dir.parent)}:{name}"
        if key in seen:
            continue
        seen[key] = _body_lines(hit[1], modules[hit[0]][2])
        for call in ast.walk(hit[1]):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                todo.append((hit[0], call.func.id))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    counts = count(pathlib.Path(dtensor_moe.__file__).parent)
    if args.list:
        for key, n in sorted(counts.items()):
            print(f"{n:4d}  {key}")
    print(f"hand-written backward: {sum(counts.values())} lines in {len(counts)} functions")


if __name__ == "__main__":
    main()
