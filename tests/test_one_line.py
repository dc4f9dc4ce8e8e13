"""Every promised one-line error is one line (issue 53, items 3 and 4): a launcher environment that is half set, or
fully set with no launch behind it (variables left in a shell: it fails within its join window, listening on
MASTER_ADDR only), Ctrl-C, the MOE_WAVE_* variables that take ``auto`` or on/off; ``--help`` without torch.
CPU only; the subprocesses bind to loopback only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_wave.env import read_env

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MOE_WAVE_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **extra}


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def _cli(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "moe_wave", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the environment's knobs

@pytest.mark.parametrize("value, dense", [("on", True), ("off", False), ("1", True), ("0", False), ("auto", None)])
def test_symm_dense_takes_what_the_readme_shows(value, dense):
    assert read_env({"MOE_WAVE_SYMM_DENSE": value}).symm.get("dense") is dense


@pytest.mark.parametrize("var", ["MOE_WAVE_GRAPH", "MOE_WAVE_ATTN_KERNELS", "MOE_WAVE_SYMM_DENSE"])
def test_auto_variables_list_auto_in_their_error(var):
    with pytest.raises(ValueError, match=rf"{var}='maybe': must be auto, 1 or 0 \(also on/off"):
        read_env({var: "maybe"})


# ----------------------------------------------------------------------------- --help

def test_top_level_help_lists_what_the_full_parser_lists():
    from moe_wave.cli import build_parser, light_parser

    assert light_parser().format_help() == build_parser().format_help()


def test_help_and_version_import_no_torch():
    code = ("import sys\nfrom moe_wave.cli import main\nfor argv in (['--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 0 and "usage: moe-wave" in proc.stdout and "moe-wave 0.1" in proc.stdout, proc.stderr


# ----------------------------------------------------------------------------- launcher environments

@pytest.mark.timeout(120)
def test_half_set_launcher_under_demo_is_one_line():
    proc = _cli("demo", "--preset", "tiny", env=_env(RANK="0", WORLD_SIZE="2"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr).startswith("moe-wave demo: error: RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR "
                                             "and MASTER_PORT are not")


def _listeners(port: int) -> list[str]:
    """The local addresses listening on ``port`` (hex, as /proc/net/tcp{,6} write them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp to see the listening socket")
def test_leftover_launcher_env_is_one_line_and_listens_on_loopback():
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left in a shell, no torchrun: the demo's rank 0 listens on
    MASTER_ADDR only while it waits for peers, and ends with one line naming the variables when none come."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moe_wave", "demo", "--preset", "tiny"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    seen = []
    while proc.poll() is None and not seen:
        seen = _listeners(port)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=150)
    assert seen == ["0100007F"], f"listening on {seen} (0100007F is 127.0.0.1)"
    assert proc.returncode == 2, err[-3000:]
    assert _one_line(err).startswith(f"moe-wave demo: error: RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, "
                                     f"MASTER_PORT={port} are set but no launch is behind them (1 of 2 ranks joined")


@pytest.mark.timeout(120)
def test_a_rank_with_no_store_to_join_is_one_line():
    proc = _cli("demo", "--preset", "tiny",
                env=_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "are set but no launch is behind them (no store at 127.0.0.1:" in _one_line(proc.stderr)


# ----------------------------------------------------------------------------- Ctrl-C

def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc to see the ranks")
def test_ctrl_c_is_one_line():
    """Ctrl-C reaches the whole foreground process group (the demo and its ranks): one line, exit 130."""
    proc = subprocess.Popen([sys.executable, "-m", "moe_wave", "demo", "--preset", "tiny", "--ranks", "2",
                             "--iters", "100000"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    try:
        while proc.poll() is None and sum("spawn_main" in _cmdline(c) for c in _children(proc.pid)) < 2:
            time.sleep(0.1)
        time.sleep(1.0)       # the ranks are importing or running: either way Ctrl-C must be one line
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert _one_line(err) == "moe-wave demo: interrupted"


# ----------------------------------------------------------------------------- the sweep's --out

@pytest.mark.timeout(120)
def test_a_second_sweep_on_one_out_names_the_first(tmp_path):
    from moe_wave.tools import sweep_csv

    out = tmp_path / "s.csv"
    with sweep_csv.locked(out):
        proc = _cli("sweep", "--preset", "tiny", "--tokens", "8", "--waves", "1", "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr).startswith(f"moe-wave sweep: error: --out={str(out)!r} is in use by another sweep "
                                             f"(pid {os.getpid()} on {socket.gethostname()} since ")
    assert not out.exists(), "the second sweep wrote nothing"
    assert not Path(f"{out}.lock").exists(), "the lock is gone with its holder"
    with sweep_csv.locked(out):         # free again
        pass
