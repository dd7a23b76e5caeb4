"""The Python blocks of the README and the docs stay true to the code.

Every block parses. Every name a block takes from ``gemini_ckpt`` or ``placement`` exists, every
attribute it reads from such a name exists, and every keyword it passes to one of our callables
is one that callable accepts (a renamed config field or function breaks this test, not a
reader's first try). A block that needs nothing from outside itself (no free names, no cluster)
runs. The rest are fragments of a larger program (``model``, ``opt``, a Ray cluster) by nature.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re

import pytest
import paths

ROOT = paths.ROOT
OURS = ("gemini_ckpt", "placement")
NEEDS_A_CLUSTER = ("ray", "gemini_ckpt.testing.cluster", "gemini_ckpt.chaos", "lightning", "transformers")


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"```(?:python|py)\n(.*?)```", text, re.S):
            out.append((str(path.relative_to(ROOT)), text[: m.start()].count("\n") + 2, m.group(1)))
    return out


BLOCKS = _blocks()


def _ids() -> list[str]:
    return [f"{where}:{line}" for where, line, _ in BLOCKS]


def _ours(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in OURS


def _imported(tree: ast.Module) -> dict[str, object]:
    """The names the block binds by importing from our packages, resolved."""
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else importlib.import_module(alias.name.split(".")[0])
                    )
        elif isinstance(node, ast.ImportFrom) and _ours(node.module):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
                else:  # a submodule
                    bound[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
    return bound


def _resolve(node: ast.AST, bound: dict[str, object]):
    """The object an expression like ``gray.torch_config`` names, if it starts at one of ours."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, bound)
        if base is None:
            return None
        assert hasattr(base, node.attr), f"{ast.unparse(node)}: {base!r} has no attribute {node.attr!r}"
        return getattr(base, node.attr)
    return None


def _free_names(tree: ast.Module) -> set[str]:
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    stored |= {
        a.asname or a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    stored |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stored |= {
        a.arg
        for n in ast.walk(tree)
        if isinstance(n, ast.arguments)
        for a in [*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg]
        if a is not None
    }
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - stored - set(dir(builtins))


def test_there_are_blocks_to_check():
    assert len(BLOCKS) >= 15 and any(where == "README.md" for where, _, _ in BLOCKS)


@pytest.mark.parametrize("where,line,code", BLOCKS, ids=_ids())
def test_a_block_parses_and_uses_only_names_and_keywords_that_exist(where, line, code):
    tree = ast.parse(code, filename=f"{where}:{line}")
    bound = _imported(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            _resolve(node, bound)
        if isinstance(node, ast.Call) and node.keywords:
            target = _resolve(node.func, bound)
            if target is None or not callable(target):
                continue
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                assert kw.arg is None or kw.arg in params, (
                    f"{where}:{line}: {ast.unparse(node.func)}() takes no keyword {kw.arg!r}"
                )


def _runnable(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False  # the parse test names it
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return not _free_names(tree) and not any(m == c or m.startswith(c + ".") for m in modules for c in NEEDS_A_CLUSTER)


RUNNABLE = [b for b in BLOCKS if _runnable(b[2])]


def test_the_self_contained_blocks_are_found():
    assert {where for where, _, _ in RUNNABLE} >= {"docs/placement.md", "docs/advise.md"}


@pytest.mark.parametrize("where,line,code", RUNNABLE, ids=[f"{w}:{n}" for w, n, _ in RUNNABLE])
def test_a_self_contained_block_runs(where, line, code):
    exec(compile(code, f"{where}:{line}", "exec"), {"__name__": "doc_example"})  # noqa: S102 - our own docs
