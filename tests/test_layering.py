"""The import graph of moe_wave and comm (read with ast, nothing imported): no cycles, the library never
imports a tool, comm never imports the model side, and no library module reads MOE_WAVE_* variables.

Every import counts, a function-level (lazy) one too: a lazy import hides a cycle from Python, not from
a reader. ``import a.b.c`` and ``from a.b import c`` are edges to the deepest module named; the implicit
import of a parent package is not an edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# entry points and tools: they may import anything of the library, the library none of them
TOOLS = re.compile(r"^moe_wave\.(tools(\..*)?|cli|__main__)$")
# the only modules under moe_wave/ and comm/ that may read MOE_WAVE_* variables
# moe_wave.env, and the DeepEP front door, which serving stacks import with no moe-wave CLI in between (its path
# switches MOE_WAVE_{NORMAL,LL}_PATH and tunables are read where a Buffer is made)
ENV_READERS = {"moe_wave.env", "moe_wave.deepep_compat.buffer", "moe_wave.deepep_compat.low_latency",
               "moe_wave.deepep_compat.ll_direct", "moe_wave.deepep_compat.normal_kernels",
               "moe_wave.deepep_compat.triton_launch"}


def _modules() -> dict[str, Path]:
    """Module name -> file, comm/ mounted as moe_wave.comm (moe_wave/comm is a link to it)."""
    mods = {}
    for base, prefix in ((ROOT / "moe_wave", "moe_wave"), (ROOT / "comm", "moe_wave.comm")):
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base)
            if prefix == "moe_wave" and rel.parts[0] == "comm":
                continue
            parts = [prefix, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _deepest(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the moe_wave modules it imports."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                dep = _deepest(t, mods)
                if dep is not None and dep != mod:
                    edges.add(dep)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_packages():
    g = import_graph()
    assert "moe_wave.moe" in g and "moe_wave.comm.symm" in g and "moe_wave.tools.sweep" in g
    assert "moe_wave.comm.layout" in g["moe_wave.moe"], "an edge the graph must see"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_never_imports_a_tool():
    bad = {m: sorted(d for d in deps if TOOLS.match(d)) for m, deps in import_graph().items() if not TOOLS.match(m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_comm_never_imports_the_model_side():
    bad = {m: sorted(d for d in deps if not d.startswith("moe_wave.comm"))
           for m, deps in import_graph().items() if m.startswith("moe_wave.comm")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_library_reads_no_moe_wave_variables():
    """The environment is read in one place (moe_wave.env, called by the CLI and the launch scripts)."""
    reads = re.compile(r"(os\.environ|os\.getenv|environ\.get)[^\n]*MOE_WAVE_|MOE_WAVE_\w+\"?\s*in\s+os\.environ")
    bad = [m for m, p in _modules().items() if m not in ENV_READERS and reads.search(p.read_text())]
    assert bad == []
