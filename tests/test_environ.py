"""``moe_wave.comm.environ``: declared names only (a ValueError names the variable and the rule otherwise), a live
read-only view, writes that check every name before setting any; and, read with ast, the names the library gives it:
each declared, the ``MOE_WAVE_*`` ones in moe_wave.env only, each row's users the modules that spell it."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from moe_wave.comm import environ
from tests.test_layering import _modules

UNDECLARED = "NOT_A_MOE_WAVE_VARIABLE"


def _undeclared(fn):
    with pytest.raises(ValueError) as e:
        fn()
    assert UNDECLARED in str(e.value) and "declare it in comm/environ.py's table" in str(e.value), str(e.value)


def test_declared_by_name_and_by_family():
    assert environ.entry("RANK") == "RANK" and environ.entry("MOE_WAVE_NVTX") == "MOE_WAVE_*"
    assert environ.declared("TRITON_INTERPRET") and not environ.declared(UNDECLARED)
    assert not environ.declared("MOE_WAVE_"), "a family's prefix alone is no variable"
    assert not environ.declared("RANKS") and not environ.declared(3)


@pytest.mark.parametrize("call", [
    lambda: environ.get(UNDECLARED), lambda: environ.get(UNDECLARED, "x"), lambda: environ.present(UNDECLARED),
    lambda: environ.view()[UNDECLARED], lambda: environ.view().get(UNDECLARED), lambda: UNDECLARED in environ.view(),
    lambda: environ.assign(UNDECLARED, "1"), lambda: environ.set_default(UNDECLARED, "1"),
    lambda: environ.update({"RANK": "0", UNDECLARED: "1"})])
def test_an_undeclared_name_is_a_value_error_naming_it(call, monkeypatch):
    monkeypatch.setenv(UNDECLARED, "set")      # set or not: the name is refused
    monkeypatch.delenv("RANK", raising=False)
    _undeclared(call)
    assert "RANK" not in os.environ, "update checks every name before it sets any"


def test_a_value_must_be_a_str(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(ValueError, match=r"OUT=1: an environment variable's value must be a str"):
        environ.assign("OUT", 1)
    with pytest.raises(ValueError, match=r"must be a str"):
        environ.update({"OUT": None})
    assert "OUT" not in os.environ


def test_the_view_is_live_and_read_only(monkeypatch):
    view = environ.view()
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert "MASTER_PORT" not in view and view.get("MASTER_PORT") is None
    with pytest.raises(KeyError):
        view["MASTER_PORT"]
    monkeypatch.setenv("MASTER_PORT", "29511")          # after the view was made
    monkeypatch.setenv(UNDECLARED, "hidden")
    assert view["MASTER_PORT"] == "29511" and environ.get("MASTER_PORT") == "29511" and environ.present("MASTER_PORT")
    assert dict(view)["MASTER_PORT"] == "29511"
    assert UNDECLARED not in list(view), "iteration lists the declared variables only"
    assert len(view) == len(list(view)) and all(environ.declared(k) for k in view)
    with pytest.raises(TypeError):
        view["MASTER_PORT"] = "1"  # type: ignore[index]


def test_writes(monkeypatch):
    for name in ("OUT", "GLOO_SOCKET_IFNAME", "NCCL_ALGO"):
        monkeypatch.delenv(name, raising=False)
    environ.assign("OUT", "/tmp/a")
    assert os.environ["OUT"] == "/tmp/a"
    assert environ.set_default("OUT", "/tmp/b") == "/tmp/a" and os.environ["OUT"] == "/tmp/a"
    assert environ.set_default("GLOO_SOCKET_IFNAME", "lo") == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    environ.update({"OUT": "/tmp/c", "NCCL_ALGO": "Ring"})
    assert (os.environ["OUT"], os.environ["NCCL_ALGO"]) == ("/tmp/c", "Ring")


def test_every_row_names_its_users_and_meaning():
    for name, row in environ.TABLE.items():
        assert name == name.upper() and (not name.endswith("*") or name.endswith("_*")), name
        assert row.users and all(isinstance(u, str) and u for u in row.users) and row.meaning, name


# ----------------------------------------------------------------------------- the names the library gives it (ast)

MODULE = "moe_wave.comm.environ"
NAMED = {"get", "present", "assign", "set_default", "update"}     # the accessors that take variable names
SHAPE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")          # what an environment variable's name looks like


def _imports(mod: str, path: Path, tree) -> tuple[set[str], dict[str, str]]:
    """(the local names bound to comm.environ, local name -> accessor imported from it by name)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == MODULE:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" == MODULE:
                    modules.add(a.asname or a.name)
                elif base == MODULE:
                    functions[a.asname or a.name] = a.name
    return modules, functions


def _strings(node) -> list[str] | None:
    """The str constants of a literal: a str, a tuple / list / set of them, a dict's keys; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) \
        else None
    if items is None or not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in items):
        return None
    return [k.value for k in items]


def environ_names(mod: str, path: Path, source: str) -> tuple[dict[str, int], list[str]]:
    """(name -> line of each variable ``mod`` gives comm.environ's accessors, the calls whose names ast cannot tell).

    A name is told when it is a literal, a module-level name assigned a literal (``MULTICAST_OFF = {...}``) or the
    variable of a loop or comprehension over one (``for k in ("RANK", ...)``), within that loop;
    ``view()[...]`` counts as a read."""
    tree = ast.parse(source, str(path))
    modules, functions = _imports(mod, path, tree)
    constants: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (values := _strings(node.value)) is not None:
                constants[node.targets[0].id] = values

    def tell(arg, bound) -> list[str] | None:
        return bound.get(arg.id) if isinstance(arg, ast.Name) else _strings(arg)

    def bind(target, over, bound) -> dict:
        inner = dict(bound)
        if isinstance(target, ast.Name):
            values = tell(over, bound)
            if values is None:
                inner.pop(target.id, None)
            else:
                inner[target.id] = values
        return inner

    def accessor(func) -> str | None:
        if isinstance(func, ast.Name):
            return functions.get(func.id)
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) in modules:
            return func.attr
        return None

    names, unknown = {}, []

    def check(node, bound) -> None:
        if isinstance(node, ast.Call) and accessor(node.func) in NAMED:
            arg = node.args[0] if node.args else next(iter(k.value for k in node.keywords), None)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call) and accessor(node.value.func) == "view":
            arg = node.slice
        else:
            return
        told = None if arg is None else tell(arg, bound)
        if told is None:
            unknown.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
        for name in told or ():
            names.setdefault(name, node.lineno)

    def visit(node, bound) -> None:
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            inner = bound
            for gen in node.generators:
                visit(gen.iter, inner)
                inner = bind(gen.target, gen.iter, inner)
                for cond in gen.ifs:
                    visit(cond, inner)
            for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                visit(part, inner)
            return
        if isinstance(node, ast.For):
            visit(node.iter, bound)
            inner = bind(node.target, node.iter, bound)
            for stmt in node.body:
                visit(stmt, inner)
            for stmt in node.orelse:
                visit(stmt, bound)
            return
        check(node, bound)
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(tree, constants)
    return names, unknown


def _library() -> dict[str, tuple[dict[str, int], list[str]]]:
    return {m: environ_names(m, p, p.read_text()) for m, p in _modules().items()}


def test_every_name_the_library_gives_comm_environ_is_declared():
    found = _library()
    undeclared = [f"{m}:{line}: {name}" for m, (names, _) in found.items() for name, line in names.items()
                  if not environ.declared(name)]
    unknown = [u for _, (_, us) in found.items() for u in us]
    assert undeclared == [], "declare each in comm/environ.py's table"
    assert unknown == [], "give comm.environ a name ast can tell (a literal, or a loop over one)"
    seen = {n for names, _ in found.values() for n in names}
    assert {"MASTER_ADDR", "TORCHELASTIC_RUN_ID", "NCCL_NVLS_ENABLE", "TRITON_INTERPRET", "OUT", "NCCL_PROTO"} <= seen


def test_only_moe_wave_env_gives_comm_environ_moe_wave_names():
    bad = {m: sorted(n for n in names if n.startswith("MOE_WAVE_")) for m, (names, _) in _library().items()
           if m != "moe_wave.env"}
    assert {m: n for m, n in bad.items() if n} == {}


SCANNED = '''
from moe_wave.comm import environ as penv
from moe_wave.comm.environ import get as read, view
NAMES = ("RANK", "NOT_DECLARED_A")
OFF = {"NOT_DECLARED_B": "1"}
penv.present("MOE_WAVE_OVERLAP")
read("NOT_DECLARED_C", "x")
penv.update(OFF)
x = [k for k in NAMES if penv.get(k)]
y = view()["NOT_DECLARED_D"]
penv.assign(name=some_name(), value="1")
'''


def test_the_scan_sees_every_way_of_naming_a_variable():
    names, unknown = environ_names("moe_wave.example", Path("moe_wave/example.py"), SCANNED)
    assert sorted(n for n in names if not environ.declared(n)) == [f"NOT_DECLARED_{c}" for c in "ABCD"]
    assert {"MOE_WAVE_OVERLAP", "RANK"} <= set(names)
    assert unknown == ["moe_wave.example:11: penv.assign(name=some_name(), value='1')"]


def _literals(mod: str, path: Path) -> dict[str, set[str]]:
    """TABLE key -> the declared names ``mod`` spells as literals (in any expression, docstrings aside)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SHAPE.match(node.value) \
                and environ.declared(node.value):
            out.setdefault(environ.entry(node.value), set()).add(node.value)
    return out


def test_the_table_names_who_uses_each_variable():
    """Every module that imports comm.environ and spells a declared variable is among that row's users; every row has
    a user that spells it (no row outlives its last reader); every user is a module."""
    mods = _modules()
    users: dict[str, set[str]] = {}
    for m, p in mods.items():
        if m != MODULE and any(_imports(m, p, ast.parse(p.read_text()))):
            for key in _literals(m, p):
                users.setdefault(key, set()).add(m.removeprefix("moe_wave."))
    missing = {k: sorted(u - set(environ.TABLE[k].users)) for k, u in users.items()}
    assert {k: u for k, u in missing.items() if u} == {}, "add each module to the row's users"
    assert [k for k in environ.TABLE if not users.get(k, set()) & set(environ.TABLE[k].users)] == []
    assert [u for row in environ.TABLE.values() for u in row.users if f"moe_wave.{u}" not in mods] == []
