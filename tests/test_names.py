"""Every global name a function reads is defined: the library's modules and the scripts under benchmarks/ and dev/
(much of this code runs only on a GPU host, where a name lost in a refactor shows up as a NameError only there).
Each file is imported and the LOAD_GLOBAL instructions of all its code objects are looked up in the module's
namespace and the builtins. CPU only; imports nothing that needs a GPU."""

from __future__ import annotations

import builtins
import dis
import importlib
import importlib.util
import pkgutil
import sys
import types
from pathlib import Path

import pytest

import moe_wave

ROOT = Path(__file__).resolve().parents[1]


def _missing(code: types.CodeType, names: dict, where: str) -> list[str]:
    out = [f"{where}: {ins.argval}" for ins in dis.get_instructions(code)
           if ins.opname == "LOAD_GLOBAL" and ins.argval not in names and not hasattr(builtins, ins.argval)]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _missing(c, names, f"{where}.{c.co_name}")
    return out


def _check(path: Path, namespace: dict) -> list[str]:
    code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
    return _missing(code, namespace, str(path.relative_to(ROOT)))


def test_library_functions_read_only_defined_globals():
    bad = []
    for info in pkgutil.walk_packages(moe_wave.__path__, "moe_wave."):
        mod = importlib.import_module(info.name)
        src = getattr(mod, "__file__", None)
        if src and src.endswith(".py"):
            bad += _check(Path(src), mod.__dict__)
    assert not bad, "undefined globals:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["benchmarks", "dev"])
def test_scripts_read_only_defined_globals(folder, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    bad = []
    for path in files:
        name = f"_names_{folder}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)
        spec.loader.exec_module(mod)            # the scripts run nothing on import (a __main__ guard)
        bad += _check(path, mod.__dict__)
    assert not bad, "undefined globals:\n" + "\n".join(bad)
