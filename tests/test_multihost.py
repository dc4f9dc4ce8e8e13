"""Across hosts, on one CPU: the torch backend (gloo here, NCCL on GPUs) with ranks on two simulated hosts.

Two torchrun agents, launched as on two machines (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint``), each start
2 ranks on loopback: 4 ranks in 2 groups of 2, so that every piece that tells hosts apart sees 2 hosts
(``LOCAL_WORLD_SIZE`` 2 of ``WORLD_SIZE`` 4, ``GROUP_RANK`` the host). Each rank runs WaveMoE with
``backend="torch"`` against the single-process fp32 reference, with an empty rank and tokens crossing hosts.
The MPI rendezvous's choice between a file store (one host) and TCP (several) is checked with a stand-in
``mpi4py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULT = "MULTIHOST-RESULT "


def _rank_main() -> None:
    """One rank (``python -m tests.test_multihost`` under torchrun): WaveMoE across the two hosts."""
    from moe_wave import MoEConfig, WaveConfig, WaveMoE
    from moe_wave.comm import detect_launcher, init_from_env
    from moe_wave.reference import random_full_weights, reference_moe

    info = detect_launcher()
    ep = init_from_env(timeout_s=60, device="cpu")
    host = int(os.environ["GROUP_RANK"])
    cfg = MoEConfig.preset("tiny", num_experts=8, top_k=3)
    full = random_full_weights(cfg, seed=3)
    T = [11, 0, 7, 13][ep.rank]                       # rank 1 (host 0) brings no tokens
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(ep.rank)) * 2
    ref = reference_moe(full, cfg, x)
    errs = {}
    for backend in ("torch", "auto"):                 # "auto" is the torch backend on CPU and across hosts
        for W, part, overlap in ((1, "experts", True), (2, "experts", True), (2, "tokens", False)):
            moe = WaveMoE(cfg, ep=ep, wave=WaveConfig(num_waves=W, partition=part, overlap=overlap, backend=backend))
            moe.load_full(full)
            y = moe(x)
            errs[f"{backend} W={W} {part} overlap={overlap}"] = (moe.backend.name, float((y - ref).abs().max())
                                                                 if T else float(y.numel()))
    seen = ep.gather_objects({"rank": ep.rank, "host": host, "local_rank": info.local_rank,
                              "local_world_size": info.local_world_size, "world_size": info.world_size,
                              "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "errs": errs})
    if ep.rank == 0:
        print(RESULT + json.dumps(seen), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_torch_backend_across_two_simulated_hosts():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # loopback only: across real hosts GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) names the NIC instead
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo")
    port = _free_port()
    # the first agent serves the c10d rendezvous store (torch binds it as it binds --standalone's, see README)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                                f"moe-wave-{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
                                "-m", "tests.test_multihost"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=200)[0])
    finally:
        for a in agents:
            a.kill()
    text = "\n".join(outs)
    assert all(a.returncode == 0 for a in agents), text[-4000:]
    line = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
    assert len(line) == 1, text[-4000:]
    ranks = json.loads(line[0][len(RESULT):])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    hosts = {h: sorted(r["rank"] for r in ranks if r["host"] == h) for h in {r["host"] for r in ranks}}
    assert sorted(hosts.values()) == [[0, 1], [2, 3]], hosts      # two hosts of two ranks each
    for r in ranks:
        assert (r["world_size"], r["local_world_size"], r["local_rank"]) == (4, 2, r["rank"] % 2), r
        assert r["gloo_ifname"] == "lo", r
        assert len(r["errs"]) == 6, r
        for what, (name, err) in r["errs"].items():
            assert name == "torch" and err <= 1e-5, (r["rank"], what, name, err)


# ----------------------------------------------------------------------------- the MPI rendezvous

def _fake_mpi(monkeypatch, hosts: list[str], rank: int) -> None:
    """A stand-in ``mpi4py`` whose COMM_WORLD reports ``hosts`` and broadcasts rank 0's value as is."""
    comm = types.SimpleNamespace(allgather=lambda _: list(hosts), bcast=lambda value, root=0: value)
    mod = types.ModuleType("mpi4py")
    mod.MPI = types.SimpleNamespace(COMM_WORLD=comm)
    monkeypatch.setitem(sys.modules, "mpi4py", mod)
    monkeypatch.setattr(socket, "gethostname", lambda: hosts[rank])


def test_mpi_rendezvous_file_store_on_one_host_tcp_across_hosts(monkeypatch, tmp_path):
    from moe_wave.comm.bootstrap import LaunchInfo, _mpi_rendezvous

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")      # no port probing: nothing binds in this test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    info = LaunchInfo("openmpi", 0, 4, 0, 4)
    _fake_mpi(monkeypatch, ["n0"] * 4, 0)
    one = _mpi_rendezvous(info)
    assert one.startswith("file://") and one.endswith("/store"), one          # one host: no socket at all
    info = LaunchInfo("openmpi", 0, 4, 0, 2)
    _fake_mpi(monkeypatch, ["n0", "n0", "n1", "n1"], 0)
    assert _mpi_rendezvous(info) == "tcp://n0:29555"                           # across hosts: rank 0's host
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    assert _mpi_rendezvous(info) == "tcp://10.0.0.7:29555"                     # MASTER_ADDR wins


if __name__ == "__main__":     # one rank of test_torch_backend_across_two_simulated_hosts
    _rank_main()
