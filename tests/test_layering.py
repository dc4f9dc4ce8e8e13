"""The import graph of moe_wave and comm (read with ast, nothing imported): no cycles (the ``deep_ep`` shim
included), the library never imports a tool, comm never imports the model side, no library module but
moe_wave.env reads MOE_WAVE_* variables, and one module only touches the process environment (comm.environ, whose
table declares every variable: tests/test_environ.py checks the names given to it).

Every import counts, a function-level (lazy) one too: a lazy import hides a cycle from Python, not from
a reader. ``import a.b.c`` and ``from a.b import c`` are edges to the deepest module named; the implicit
import of a parent package is not an edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# entry points and tools: they may import anything of the library, the library none of them
TOOLS = re.compile(r"^moe_wave\.(tools(\..*)?|cli|__main__)$")
# the only module under moe_wave/ and comm/ that may read MOE_WAVE_* variables, through comm.environ (the DeepEP
# front door, which serving stacks import with no moe-wave CLI in between, asks it for its defaults:
# env.deepep_options)
ENV_READERS = {"moe_wave.env"}
# the only module under moe_wave/ and comm/, the CLI and the tools included, that touches os.environ: the others read
# and set the process environment through it (moe_wave.env the MOE_WAVE_* family, comm.bootstrap the launchers'
# variables, comm.triton_gate TRITON_INTERPRET, ...), by the names its table declares
ENVIRON_READERS = {"moe_wave.comm.environ"}
# reading or setting the process environment other than through comm.environ
TOUCHES_ENVIRON = re.compile(r"\bos\.(environb?|getenv|putenv|unsetenv)\b|\bgetenv\(|"
                             r"\bfrom\s+os\s+import\b[^\n]*\b(environb?|getenv|putenv|unsetenv)\b")
# a MOE_WAVE_* variable read from os.environ or through comm.environ (tests/test_environ.py also checks the names
# the accessors are given, by ast)
READS_MOE_WAVE = re.compile(r"\b(os\.environ|os\.getenv|environ\.(get|present|set|set_default|update|view))\b"
                            r"[^\n]*MOE_WAVE_|MOE_WAVE_\w+\"?\s*in\s+(os\.)?environ\b")
SHIM = ROOT / "moe_wave" / "deepep_compat" / "shim"


def _modules() -> dict[str, Path]:
    """Module name -> file, comm/ mounted as moe_wave.comm (moe_wave/comm is a link to it), the shim's files as
    the ``deep_ep`` package they are imported as."""
    mods = {}
    for base, prefix in ((ROOT / "moe_wave", "moe_wave"), (ROOT / "comm", "moe_wave.comm"), (SHIM, "")):
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base)
            if prefix == "moe_wave" and (rel.parts[0] == "comm" or f.is_relative_to(SHIM)):
                continue
            parts = [prefix, *rel.with_suffix("").parts] if prefix else list(rel.with_suffix("").parts)
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


def test_the_shim_imports_the_package_never_the_reverse():
    """``deep_ep`` (the shim) imports moe_wave.deepep_compat; nothing of moe_wave.deepep_compat imports ``deep_ep``
    back (a function-level ``import deep_ep`` in ``install()`` made the house's only import circle). The
    ``deepep`` comm backend imports a real DeepEP by that name; the graph counts it too (no cycle through it)."""
    g = import_graph()
    assert "deep_ep" in g and "moe_wave.deepep_compat" in g["deep_ep"]
    back = {m: sorted(d for d in deps if d.split(".")[0] == "deep_ep") for m, deps in g.items()
            if m.startswith("moe_wave.deepep_compat")}
    assert {m: d for m, d in back.items() if d} == {}


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_never_imports_a_tool():
    bad = {m: sorted(d for d in deps if TOOLS.match(d)) for m, deps in import_graph().items() if not TOOLS.match(m)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_comm_never_imports_the_model_side():
    # ``import deep_ep`` in the deepep backend means a real DeepEP (the graph names the shim by that name)
    bad = {m: sorted(d for d in deps if not d.startswith("moe_wave.comm") and d.split(".")[0] != "deep_ep")
           for m, deps in import_graph().items() if m.startswith("moe_wave.comm")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_library_reads_no_moe_wave_variables():
    """The MOE_WAVE_* variables are parsed in one place (moe_wave.env, called by the CLI and the launch scripts)."""
    bad = [m for m, p in _modules().items() if m not in ENV_READERS and READS_MOE_WAVE.search(p.read_text())]
    assert bad == []


def test_one_module_touches_the_process_environment():
    """No module but ``ENVIRON_READERS`` (comm.environ) touches ``os.environ``: the library, the CLI and the tools
    read and set the environment through it."""
    bad = [m for m, p in _modules().items() if m not in ENVIRON_READERS and TOUCHES_ENVIRON.search(p.read_text())]
    assert bad == []
    assert all(TOUCHES_ENVIRON.search(_modules()[m].read_text()) for m in ENVIRON_READERS), "the readers are seen"


@pytest.mark.parametrize("line, touches, moe_wave", [
    ('x = os.environ.get("RANK")', True, False), ("os.environ['MOE_WAVE_NVTX'] = '1'", True, True),
    ('os.getenv("MOE_WAVE_X")', True, True), ("from os import environ, path", True, False),
    ("from os import getenv", True, False), ('os.putenv("A", "1")', True, False),
    ('environ.present("MOE_WAVE_OVERLAP")', False, True), ('env = environ.view()["MOE_WAVE_CACHE"]', False, True),
    ('if "MOE_WAVE_NVTX" in environ.view():', False, True), ('environ.get("RANK")', False, False),
    ("n = os.cpu_count()", False, False), ("from os import path", False, False)])
def test_the_environment_rules_see_a_read(line, touches, moe_wave):
    assert (bool(TOUCHES_ENVIRON.search(line)), bool(READS_MOE_WAVE.search(line))) == (touches, moe_wave)
