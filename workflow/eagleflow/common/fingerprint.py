"""Fingerprints of code and parameters: what a cached or built artifact was made with.

`code_fingerprint` hashes the AST of a module and every `eagleflow` module it
imports, transitively, so that a comment or docstring-free formatting change does not count
as a code change while any change in behaviour does. The Snakemake rules pass it as a
param (Snakemake itself only tracks the mtime of a `script:` file), and training keys its
checkpoints on it.

The walk stops at `eagleflow.runtime`: the code that starts servers, retries, throttles,
logs and supervises a stage decides none of its bytes, so editing it restales nothing. What of
it can change a result (the vLLM flags it launches with) reaches the keys as data
(runtime.server_args).
"""

from __future__ import annotations

import ast
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE = "eagleflow"
RUNTIME = f"{PACKAGE}.runtime"  # run-only code: in no fingerprint


ROOT = Path(__file__).resolve().parents[1]  # the eagleflow package directory


def _module_file(name: str, root: Path) -> Path | None:
    """Source file of a eagleflow module, found on disk (importing it would run it)."""
    parts = name.split(".")[1:]
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None  # an attribute imported from a module, not a module


def runs_module(name: str) -> str:
    """Declare, where a module names another that runs elsewhere (vLLM's engine loads the
    hidden-states connector by its module path, in the server's process), that the caller's
    results depend on it: the fingerprint scan counts `runs_module("eagleflow.<module>")` as
    an import of that module (_imports). Returns `name`."""
    return name


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == runs_module.__name__
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{a.name}" for a in node.names)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


@cache
def _module_digest(path: Path, module: str, mtime_ns: int) -> tuple[str, frozenset[str]]:
    """(digest of the docstring-free AST, eagleflow modules it imports) of one file.

    Cached per file and mtime: every rule's fingerprint walks the shared modules again, and
    parsing them once per rule made `snakemake -n` measurably slower.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    imports = frozenset(_imports(tree, module, path.name == "__init__.py"))
    return hashlib.sha256(ast.dump(_strip_docstrings(tree)).encode()).hexdigest(), imports


def is_runtime(module: str) -> bool:
    """Whether `module` is run-only code (eagleflow.runtime and below)."""
    return module == RUNTIME or module.startswith(RUNTIME + ".")


def module_digests(module: str, root: Path = ROOT) -> dict[str, str]:
    """{module: digest of its docstring-free AST} for `module` and its transitive
    eagleflow imports, less the run-only ones (eagleflow.runtime and what only
    they import): the code that decides what `module` computes."""
    todo, digests = [module], {}
    while todo:
        name = todo.pop()
        if name in digests or (is_runtime(name) and name != module):
            continue
        path = _module_file(name, Path(root))
        if path is None:
            digests[name] = ""  # an attribute imported from a module, not a module
            continue
        digest, imports = _module_digest(path, name, path.stat().st_mtime_ns)
        todo.extend(imports)
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        todo.extend(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))
        digests[name] = digest
    return {name: digest for name, digest in digests.items() if digest}


@cache
def code_fingerprint(module: str, root: Path = ROOT) -> str:
    """sha256 over the docstring-free ASTs of `module` and its transitive package imports.

    `root` is the eagleflow directory to read (a workflow copy passes its own).
    """
    return hashlib.sha256(json.dumps(sorted(module_digests(module, root).items())).encode()).hexdigest()[:16]


def value_fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stable_fraction(seed: int, key: str) -> float:
    """A uniform number in [0, 1] fixed by (seed, key): the same on every run and machine.

    Splits (train/eval prompts, train/eval samples) compare it with their fraction.
    """
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
