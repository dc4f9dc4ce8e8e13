"""The cost model (moe_wave.tools.costmodel) and ``python -m moe_wave plan``: the fit recovers known parameters from
synthetic points, says which ones the points cannot fix, projects monotonically and to the right limits, and
the CLI refuses bad flags with one line."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from moe_wave.cli import main
from moe_wave.config import MoEConfig
from moe_wave.tools.costmodel import (CommSample, LayerCostModel, LinearFit, MoESample, Topology, fit, fit_linear,
                                      held_out, leave_one_out, rows_per_token, schedule_us, summarize, traffic_MB)
from moe_wave.tools.plan import default_data, load_points

FLASH, PRO = MoEConfig.preset("v4-flash"), MoEConfig.preset("v4-pro")


# ----------------------------------------------------------------------------- traffic

def test_rows_per_token_limits_and_exact_count():
    assert rows_per_token(256, 6, 1) == pytest.approx(1.0)        # one cell: every token sends one row
    assert rows_per_token(256, 6, 256) == pytest.approx(6.0)      # a cell per expert: K rows
    assert rows_per_token(256, 6, 32, 8) == pytest.approx(6.0)
    seq = [rows_per_token(256, 6, c) for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert seq == sorted(seq)                                     # more cells, more rows (dedup helps less)
    assert rows_per_token(256, 6, 2, 4) == pytest.approx(rows_per_token(256, 6, 8))   # waves are cells too
    # exact count for E=6, K=2, 3 ranks of 2 experts: over all 15 expert pairs, the cells a pair touches
    cells = [len({a // 2, b // 2}) for a, b in itertools.combinations(range(6), 2)]
    assert rows_per_token(6, 2, 3) == pytest.approx(sum(cells) / len(cells))
    # uneven waves (6 local experts in 4 waves: 1, 2, 1, 2), as WavePlan.expert_bounds splits them
    uneven = [len({(a // 6, (a % 6) * 4 // 6), (b // 6, (b % 6) * 4 // 6)})
              for a, b in itertools.combinations(range(12), 2)]
    assert rows_per_token(12, 2, 2, 4) == pytest.approx(sum(uneven) / len(uneven))
    with pytest.raises(ValueError, match="ranks=5 must be >= 1 and divide num_experts=256"):
        rows_per_token(256, 6, 5)
    with pytest.raises(ValueError, match=r"waves=9 must be in \[1, 8\]"):
        rows_per_token(256, 6, 32, 9)


def test_traffic_splits_between_nvlink_and_rdma():
    nvl, rdma = traffic_MB(FLASH, Topology(ranks=8), 4096, 1, "combine")
    assert rdma == 0 and nvl > 0                                  # one host: NVLink only
    nvl16, rdma16 = traffic_MB(FLASH, Topology(ranks=16), 4096, 1, "combine")
    assert rdma16 > 0 and nvl16 / (nvl16 + rdma16) == pytest.approx(7 / 15)   # 7 of 15 peers share the host
    # the measured EP2 point: 4096 tokens of V4-Flash send ~1.97 rows each, half of them to the peer
    assert nvl == pytest.approx(4096 * rows_per_token(256, 6, 8) * 7 / 8 * 8192 / 1e6)
    assert traffic_MB(PRO, Topology(ranks=64), 4096, 4, "combine")[1] > 0     # 6 local experts in 4 waves
    assert traffic_MB(FLASH, Topology(ranks=2), 4096, 1, "combine")[0] == pytest.approx(33.0, rel=0.02)
    assert traffic_MB(FLASH, Topology(ranks=1), 4096, 1, "dispatch") == (0.0, 0.0)


def test_topology_errors_name_the_field():
    with pytest.raises(ValueError, match=r"Topology.ranks=12: beyond one host it must be a multiple of "
                                         r"gpus_per_host=8"):
        Topology(ranks=12)
    with pytest.raises(ValueError, match=r"Topology.rdma_GBps=0: must be > 0"):
        Topology(ranks=16, rdma_GBps=0)
    with pytest.raises(ValueError, match=r"Topology.ranks=0: must be >= 1"):
        Topology(ranks=0)


# ----------------------------------------------------------------------------- the fit

def test_fit_linear_recovers_known_parameters():
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.uniform(1, 100, 30), np.ones(30), rng.integers(1, 8, 30)])
    truth = np.array([2.5, 12.0, 0.8])
    f = fit_linear(("a", "b", "c"), X, X @ truth, prior=(9, 9, 9))
    assert f.status == ("fitted",) * 3 and np.allclose(f.values, truth, rtol=1e-9)
    noisy = X @ truth * (1 + rng.normal(0, 0.01, 30))
    assert np.allclose(fit_linear(("a", "b", "c"), X, noisy, prior=(9, 9, 9)).values, truth, rtol=0.1)


def test_fit_linear_keeps_the_prior_where_the_points_cannot_tell_and_clamps_negatives():
    X = np.column_stack([np.arange(1.0, 11.0), np.ones(10), np.full(10, 3.0)])   # column c = 3 x column b
    f = fit_linear(("a", "b", "c"), X, X @ [2.0, 5.0, 1.0], prior=(0, 0, 1.0))
    assert f.status == ("fitted", "fitted", "prior") and f["c"] == 1.0
    assert f["a"] == pytest.approx(2.0) and f["b"] == pytest.approx(5.0)
    # y falls with x: the slope would be negative, so it is 0 and the intercept alone is fitted
    X2 = np.column_stack([np.arange(1.0, 6.0), np.ones(5)])
    f2 = fit_linear(("slope", "icept"), X2, [10, 9, 8, 7, 6], prior=(1, 1))
    assert f2.status == ("zero", "fitted") and f2["slope"] == 0.0 and 6 < f2["icept"] < 10
    with pytest.raises(ValueError, match="measured values must be > 0"):
        fit_linear(("a",), [[1.0]], [0.0], prior=(1,))


TRUE = LayerCostModel(
    dispatch=LinearFit(("us_per_MB", "latency_us", "per_peer_us"), (2.8, 12.0, 1.5), ("fitted",) * 3, 0),
    combine=LinearFit(("us_per_MB", "latency_us", "per_peer_us"), (3.8, 11.0, 2.0), ("fitted",) * 3, 0),
    prepare=LinearFit(("latency_us", "per_peer_us"), (30.0, 3.0), ("fitted",) * 2, 0),
    compute=LinearFit(("us_per_TFLOP", "us_per_GB", "per_wave_us", "fixed_us"),
                      (1400.0, 300.0, 60.0, 25.0), ("fitted",) * 4, 0),
    layer_comm=LinearFit(("scale", "extra_us", "per_wave_us"), (1.4, 50.0, 20.0), ("fitted",) * 3, 0),
    unhidden=0.4, unhidden_status="fitted")


def _synthetic(model: LayerCostModel, ranks=(2, 4, 8), noise=0.0, seed=0):
    """Points that ``model`` would measure (one host), with relative noise."""
    rnd = random.Random(seed)
    jitter = lambda v: v * (1 + rnd.gauss(0, noise))  # noqa: E731
    comm, moe = [], []
    for P, cfg, T in itertools.product(ranks, (FLASH, PRO), (128, 512, 4096)):
        topo = Topology(ranks=P)
        comm.append(CommSample(cfg=cfg, ranks=P, tokens=T,
                               dispatch_us=jitter(model.exchange_us("dispatch", cfg, topo, T, 1)),
                               combine_us=jitter(model.exchange_us("combine", cfg, topo, T, 1)),
                               prepare_us=jitter(model.prepare_us(topo))))
        for W in (1, 2, 4):
            p = model.project(cfg, topo, T, W)
            moe.append(MoESample(cfg=cfg, ranks=P, tokens=T, waves=W, comm_only_us=jitter(p.comm_us),
                                 compute_only_us=jitter(p.compute_us), pipelined_us=jitter(p.pipelined_us)))
    return comm, moe


def test_fit_recovers_the_model_that_made_the_points():
    got = fit(*_synthetic(TRUE))
    for f_got, f_true in ((got.dispatch, TRUE.dispatch), (got.combine, TRUE.combine), (got.prepare, TRUE.prepare),
                          (got.compute, TRUE.compute), (got.layer_comm, TRUE.layer_comm)):
        assert set(f_got.status) == {"fitted"}, f_got
        assert np.allclose(f_got.values, f_true.values, rtol=1e-6), (f_got, f_true)
    assert got.unhidden == pytest.approx(TRUE.unhidden, rel=1e-6)
    # from EP2 points alone the per-peer cost cannot be told from the latency: it keeps its prior
    ep2 = fit(*_synthetic(TRUE, ranks=(2,)))
    assert ep2.dispatch.status == ("fitted", "fitted", "prior") and ep2.notes


def test_unseen_points_leave_one_out_and_held_out_ep():
    comm, moe = _synthetic(TRUE)
    exact = summarize(leave_one_out(comm, moe))
    assert set(exact) == {"dispatch", "combine", "compute", "pipelined", "comm_only"}
    assert all(s["max"] < 1e-6 for s in exact.values()), exact
    held = held_out(comm, moe, 8)           # fitted on EP2 and EP4, predicting EP8
    assert held and all(e.sample.ranks == 8 for e in held)
    assert max(abs(e.rel) for e in held) < 1e-6
    noisy = summarize(leave_one_out(*_synthetic(TRUE, noise=0.03, seed=1)))
    assert 0 < noisy["dispatch"]["median"] < 0.1, noisy


# ----------------------------------------------------------------------------- projection

def test_schedule_limits():
    assert schedule_us([5.0], [100.0], [7.0]) == 112.0           # one wave: nothing overlaps
    assert schedule_us([0.0] * 4, [25.0] * 4, [0.0] * 4) == 100.0
    serial = 4 * (5 + 25 + 7)
    assert 100 + 5 + 7 <= schedule_us([5.0] * 4, [25.0] * 4, [7.0] * 4) < serial


def test_projection_monotone_and_limits():
    m = TRUE
    one = m.project(FLASH, Topology(ranks=1), 4096, 4)
    assert one.comm_us == 0 and one.rdma_MB == 0 and one.pipelined_us == pytest.approx(one.compute_us)
    for P in (2, 8, 16, 64):
        topo = Topology(ranks=P)
        times = [m.project(FLASH, topo, T, 2) for T in (128, 1024, 4096, 8192)]
        for a, b in zip(times, times[1:]):
            assert a.dispatch_us < b.dispatch_us and a.combine_us < b.combine_us and a.compute_us < b.compute_us
            assert a.serial_us < b.serial_us
        assert all(t.pipelined_us <= t.serial_us for t in times)
        one_wave = m.project(FLASH, topo, 4096, 1)
        assert one_wave.pipelined_us == pytest.approx(one_wave.serial_us)      # one wave hides nothing
        assert (times[0].rdma_MB > 0) == (P > 8)
    # fewer weights per rank as EP grows: compute falls; a slower RDMA link only slows the exchanges
    comp = [m.project(FLASH, Topology(ranks=P), 128, 1).compute_us for P in (2, 4, 8, 16, 32, 64)]
    assert comp == sorted(comp, reverse=True)
    fast, slow = (m.project(FLASH, Topology(ranks=64, rdma_GBps=g), 4096, 2) for g in (100.0, 25.0))
    assert slow.dispatch_us > fast.dispatch_us and slow.compute_us == fast.compute_us
    # within a host the remote share grows with P: (P-1)/P of the rows leave the GPU
    ep8, ep2 = (m.project(FLASH, Topology(ranks=P), 4096, 1) for P in (8, 2))
    assert ep8.nvlink_MB > ep2.nvlink_MB
    # NVLink set by hand: infinite bandwidth leaves only the latency terms
    lat = m.exchange_us("dispatch", FLASH, Topology(ranks=8, nvlink_GBps=1e12), 4096, 1)
    assert lat == pytest.approx(12.0 + 1.5 * 7, rel=1e-6)
    best = m.best(FLASH, Topology(ranks=8), 4096, (1, 2, 4, 8))
    assert best.pipelined_us == min(m.project(FLASH, Topology(ranks=8), 4096, W).pipelined_us for W in (1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"ranks=12: must divide num_experts=256"):
        m.project(FLASH, Topology(ranks=12, gpus_per_host=12), 128, 1)


# ----------------------------------------------------------------------------- the committed points and the CLI

def test_committed_ep2_points_load_and_fit(capsys):
    assert main(["plan", "--ep", "8,64", "--tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "fitted on 4 comm and 12 MoE points at EP [2]" in out, out
    assert "leave-one-out" in out and "per_peer_us" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["8"], ["64"])]
    assert [(r[0], r[1], r[2]) for r in rows] == [("8", "1", "128"), ("64", "8", "128")], out


def _write(tmp_path, name, P, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {"world_size": P}, "rows": rows}))
    return str(path)


def test_plan_on_given_files_reports_held_out_ep_and_writes_json(tmp_path, capsys):
    comm, moe = _synthetic(TRUE, ranks=(2, 4, 8))
    files = []
    for P in (2, 4, 8):
        files.append(_write(tmp_path, f"comm{P}.json", P, [
            {"backend": "symm-kernel", "graph": True, "layout": "v4-flash" if s.cfg == FLASH else "v4-pro",
             "tokens_per_rank": s.tokens, "dispatch_us": s.dispatch_us, "combine_us": s.combine_us,
             "prepare_us": s.prepare_us} for s in comm if s.ranks == P] + [{"backend": "torch", "layout": "bytes"}]))
        files.append(_write(tmp_path, f"moe{P}.json", P, [
            {"backend": "symm", "cuda_graph": True, "shape": "v4-flash" if s.cfg == FLASH else "v4-pro",
             "tokens_per_rank": s.tokens, "effective_waves": s.waves, "check": "ok", "comm_only_us": s.comm_only_us,
             "compute_only_us": s.compute_only_us, "pipelined_us": s.pipelined_us} for s in moe if s.ranks == P]))
    got_comm, got_moe = load_points(files, "symm")
    assert len(got_comm) == len(comm) and len(got_moe) == len(moe)
    assert load_points(files, "deepep") == ([], [])
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--ep", "64", "--preset", "v4-pro", "--json", str(out_json)]
    assert main(argv + sum((["--data", f] for f in files), [])) == 0
    out = capsys.readouterr().out
    assert "EP8 held out" in out and "at EP [2, 4, 8]" in out, out
    doc = json.loads(out_json.read_text())
    assert [r["EP"] for r in doc["projection"]] == [64, 64] and doc["projection"][0]["hosts"] == 8
    assert all(e["max"].endswith("%") and float(e["max"][:-1]) < 0.01 for e in doc["errors"]), doc["errors"]


@pytest.mark.parametrize("argv, message", [
    (["--ep", "0"], "argument --ep: '0': must be a comma list of integers >= 1"),
    (["--ep", "4,x"], "argument --ep: '4,x': must be a comma list of integers >= 1"),
    (["--ep", "12"], "argument --ep: 12: must divide the 256 experts of v4-flash"),
    (["--ep", "12", "--preset", "v4-pro"], "argument --ep: 12: beyond one host it must be a multiple of "
                                           "--gpus-per-host 8 (whole hosts)"),
    (["--rdma-GBps", "0"], "argument --rdma-GBps: '0': must be a number > 0"),
    (["--rdma-latency-us", "-1"], "argument --rdma-latency-us: '-1': must be a number >= 0"),
    (["--tokens", "0"], "argument --tokens: '0': must be a comma list of integers >= 1"),
    (["--gpus-per-host", "0"], "argument --gpus-per-host: '0': must be an integer >= 1"),
    (["--backend", "nccl"], "argument --backend: invalid choice: 'nccl'"),
])
def test_plan_flag_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_plan_data_errors(tmp_path, capsys):
    assert main(["plan", "--data", str(tmp_path / "none.json")]) == 2
    assert f"--data {tmp_path / 'none.json'}: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["plan", "--data", str(bad)]) == 2
    assert "must be a benchmark result" in capsys.readouterr().err


def test_default_data_takes_the_committed_points_of_every_ep_size(tmp_path):
    pts = tmp_path / "benchmarks" / "results" / "points"
    pts.mkdir(parents=True)
    names = ["comm-ep2.json", "moe-ep2.json", "comm-ep8.json", "moe-ep4.json", "attn.json", "sweep-ep2.json"]
    for n in names:
        (pts / n).write_text("{}")
    (pts.parent / "comm.json").write_text("{}")
    got = [p.split("/")[-1] for p in default_data(tmp_path)]
    assert got == sorted(names[:4]), got       # other areas and the current tables stay out
