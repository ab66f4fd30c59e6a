"""The package's layers: each imports only the layers below it, and nothing forms a cycle.

Layers, bottom to top (``docs/architecture.md``): ``kernels`` < ``config``/``envs``/``tokenizer`` <
``core`` < ``attention``/``quant``/``models`` < ``worker`` < ``engine`` < ``serve``/``bench`` <
``cli``. Imports are read from the source (module level and inside functions alike). The
routes (``serve/app.py``) use the other serving modules through their public names only.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "engine" / "llmserve"

RANK = {"kernels": 0, "config": 1, "envs": 1, "tokenizer": 1, "engine_args": 1, "core": 2, "attention": 3, "quant": 3,
        "models": 3, "worker": 5, "engine": 6, "serve": 7, "bench": 7, "cli": 8, "__init__": 0, "__version__": 0}
# Same-rank neighbours that may import each other in one direction only.
ALLOWED_SAME_RANK = {("quant", "attention"), ("models", "quant"), ("quant", "models"), ("models", "attention"),
                     ("tokenizer", "envs"), ("config", "envs"),  # envs: a leaf that imports nothing
                     ("engine_args", "config"),  # the flags of the config dataclasses
                     ("bench", "serve")}  # the comparison drives the server as a client would


def _unit(mod: str) -> str:
    return mod.split(".")[0] if mod else "__init__"


def _imports(path: Path) -> set[str]:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        pkg = parts
    else:
        pkg = parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("llmserve"):
                mod = node.module[len("llmserve."):] if node.module != "llmserve" else ""
            else:
                continue
            if node.module is None:  # from . import x
                out.update(f"{mod}.{a.name}".strip(".") for a in node.names)
            else:
                out.add(mod)
        elif isinstance(node, ast.Import):
            out.update(a.name[len("llmserve."):] for a in node.names if a.name.startswith("llmserve."))
    return out


def _graph() -> dict[str, set[str]]:
    g = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        g[name] = _imports(path)
    return g


def test_every_import_points_down_the_layers():
    bad = []
    for mod, deps in _graph().items():
        u = _unit(mod)
        for d in deps:
            v = _unit(d)
            if u == v or v == "__init__":
                continue
            if RANK[v] > RANK[u] or (RANK[v] == RANK[u] and (u, v) not in ALLOWED_SAME_RANK):
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycle_between_modules():
    g = _graph()
    mods = set(g)

    def resolve(d):
        while d and d not in mods:
            d = d.rpartition(".")[0]
        return d or None

    edges = {m: {r for d in ds if (r := resolve(d)) and r != m} for m, ds in g.items()}
    # a package's __init__ importing its own submodules is not a cycle of concern
    edges = {m: {d for d in ds if not d.startswith(m + ".")} for m, ds in edges.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _private_imports_from_siblings(path: Path) -> list[str]:
    """``module.name`` for every underscore name ``path`` takes from another llmserve module:
    ``from .x import _y`` and ``from llmserve.x import _y``, and ``x._y`` where ``x`` is an
    llmserve module it imported (``from . import x``, ``import llmserve.x as x``)."""
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
            elif (node.module or "").split(".")[0] == "llmserve":
                base = PKG.parent
            else:
                continue
            base = base.joinpath(*(node.module or "").split(".")) if node.module else base
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{'.' * node.level}{node.module or ''}.{alias.name}")
                elif (base / f"{alias.name}.py").exists() or (base / alias.name / "__init__.py").exists():
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name.startswith("llmserve.") and a.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_app_imports_only_public_names():
    """``serve/app.py`` (the routes) uses the serving modules through their public names only:
    a private function or class it needs is given a public name (and a docstring) where it is defined."""
    bad = _private_imports_from_siblings(PKG / "serve" / "app.py")
    assert not bad, "serve/app.py imports private names: " + ", ".join(bad)


def test_the_private_import_check_sees_every_form(tmp_path):
    (tmp_path / "generation.py").write_text("")
    probe = tmp_path / "probe.py"
    probe.write_text("from .generation import Service, _hidden\n"
                     "from llmserve.serve.errors import _private\n"
                     "from . import generation\n"
                     "from .errors import log\n"
                     "import json\n"
                     "x = generation._inner()\n"
                     "y = json._default_encoder\n"
                     "z = log._cache\n")
    assert sorted(_private_imports_from_siblings(probe)) == [".generation._hidden", "generation._inner",
                                                             "llmserve.serve.errors._private"]
