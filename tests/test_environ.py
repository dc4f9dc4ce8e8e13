"""``moe_wave.comm.environ``: declared names only (a ValueError names the variable and the rule otherwise), a live
read-only view, writes that check every name before setting any."""

from __future__ import annotations

import os

import pytest

from moe_wave.comm import environ

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
    lambda: environ.set(UNDECLARED, "1"), lambda: environ.set_default(UNDECLARED, "1"),
    lambda: environ.update({"RANK": "0", UNDECLARED: "1"})])
def test_an_undeclared_name_is_a_value_error_naming_it(call, monkeypatch):
    monkeypatch.setenv(UNDECLARED, "set")      # set or not: the name is refused
    monkeypatch.delenv("RANK", raising=False)
    _undeclared(call)
    assert "RANK" not in os.environ, "update checks every name before it sets any"


def test_a_value_must_be_a_str(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(ValueError, match=r"OUT=1: an environment variable's value must be a str"):
        environ.set("OUT", 1)
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
    environ.set("OUT", "/tmp/a")
    assert os.environ["OUT"] == "/tmp/a"
    assert environ.set_default("OUT", "/tmp/b") == "/tmp/a" and os.environ["OUT"] == "/tmp/a"
    assert environ.set_default("GLOO_SOCKET_IFNAME", "lo") == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    environ.update({"OUT": "/tmp/c", "NCCL_ALGO": "Ring"})
    assert (os.environ["OUT"], os.environ["NCCL_ALGO"]) == ("/tmp/c", "Ring")


def test_every_row_names_its_users_and_meaning():
    for name, row in environ.TABLE.items():
        assert name == name.upper() and (not name.endswith("*") or name.endswith("_*")), name
        assert row.users and all(isinstance(u, str) and u for u in row.users) and row.meaning, name
