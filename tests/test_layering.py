"""The package's layers: each imports only the layers below it, and nothing forms a cycle.

Layers, bottom to top (``docs/architecture.md``): ``kernels`` < ``config``/``envs``/``tokenizer`` <
``core`` < ``attention``/``quant``/``models`` < ``worker`` < ``engine`` < ``serve``/``bench`` <
``cli``. Imports are read from the source (module level and inside functions alike).
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
