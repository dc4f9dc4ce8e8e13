"""A cost model of one expert-parallel MoE layer, fitted on measured points and projected to larger EP sizes
and to several hosts (``python -m moe_wave plan``).

Legend: P ranks, G GPUs per host, H = P / G hosts, T tokens per rank, D hidden, I expert width, E experts,
e = E / P local experts, K top-k, W waves. Times in microseconds, sizes in MB (1e6 bytes).

Traffic (uniform routing, the experts partition). A token is sent once per (peer, wave) cell that holds one of
its K experts; with E / (P W) experts per cell, the expected rows a token sends are

    rows_per_token = P W (1 - prod_{i<K} (E - E/(P W) - i) / (E - i))     (W dividing E / P; else per cell size)

of which (P - 1) / P leave the GPU: (G - 1) / (P - 1) of those over NVLink, the rest over RDMA.

Model, each term linear in its parameters (so that a least-squares fit finds them):

    exchange (dispatch or combine, one wave) = latency + per_peer (P - 1)
                                               + max(nvl_MB * us_per_MB, rdma_MB * 1e3 / rdma_GBps + rdma_latency)
    prepare (count exchange, once a layer)   = latency + per_peer (P - 1)
    comm in the layer                        = scale (prepare + W (dispatch + combine)) + extra + per_wave (W - 1)
    expert compute (all waves)               = fixed + per_wave (W - 1) + weight_GB * us_per_GB + TFLOP * us_per_TFLOP
    layer, serial                            = comm in the layer + expert compute
    layer, pipelined                         = schedule + unhidden * (serial - schedule)

The exchange terms are fitted on the comm benchmark's one-wave exchanges; "comm in the layer" on the MoE
benchmark's comm_only (layout, count exchange and every wave's exchanges inside WaveMoE), which costs more
(benchmarks/results/comm.md and moe.md): ``scale`` carries that to larger EP sizes, RDMA included, as fitted within one host.

``schedule`` replays the issue order of ``moe_wave.pipeline.run_waves`` on two streams (as ``autowave`` does:
the comm stream runs d0 d1 c0 d2 c1 ..., wave w's experts start when d_w has landed and wave w-1's experts are
done), with the layer's comm (count exchange included) split evenly over its 2 W exchanges. ``unhidden`` is the
share of what the replay hides that the pipeline did not hide when measured: 0 when it hides all of it, 1 when
pipelined equals serial (transfers slowing the GEMMs beside them, host work); fitted on measured (comm_only,
compute_only, pipelined) triples. With one wave nothing is hidden and pipelined equals serial.

The fit (``fit_linear``) minimises relative errors. A parameter the points cannot tell apart from the others
(``per_peer`` when every point has the same P; ``fixed`` when every point has the same weights per rank) keeps its
prior and is reported as such; a fitted value below zero is clamped to 0 and the rest refitted. Within one host
only the NVLink terms are fitted; RDMA bandwidth and latency are parameters (``Topology``). ``leave_one_out`` and
``held_out`` state the error on points a fit did not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moe_wave.config import MoEConfig

__all__ = ["Topology", "CommSample", "MoESample", "LinearFit", "LayerCostModel", "Projection", "Error",
           "rows_per_token", "traffic_MB", "fit_linear", "fit", "leave_one_out", "held_out", "summarize", "schedule_us", "replayed_us"]

BYTES_PER_ELEMENT = 2       # bf16 activations and weights
META_BYTES_PER_SLOT = 8     # dispatch: an int32 expert id and an fp32 weight per top-k slot


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where the P ranks sit.

    Attributes:
        ranks: P, the EP size.
        gpus_per_host: G; ranks beyond one host must fill whole hosts (P a multiple of G).
        rdma_GBps: RDMA bandwidth per GPU and direction between hosts (400 Gb/s NICs: 50).
        rdma_latency_us: added once to an exchange that crosses hosts.
        nvlink_GBps: per-GPU NVLink bandwidth; None takes the fitted one.
    """

    ranks: int
    gpus_per_host: int = 8
    rdma_GBps: float = 50.0
    rdma_latency_us: float = 5.0
    nvlink_GBps: float | None = None

    def __post_init__(self):
        if self.ranks < 1:
            raise ValueError(f"Topology.ranks={self.ranks}: must be >= 1")
        if self.gpus_per_host < 1:
            raise ValueError(f"Topology.gpus_per_host={self.gpus_per_host}: must be >= 1")
        if self.ranks > self.gpus_per_host and self.ranks % self.gpus_per_host:
            raise ValueError(f"Topology.ranks={self.ranks}: beyond one host it must be a multiple of "
                             f"gpus_per_host={self.gpus_per_host} (whole hosts)")
        if not self.rdma_GBps > 0:
            raise ValueError(f"Topology.rdma_GBps={self.rdma_GBps}: must be > 0")
        if not self.rdma_latency_us >= 0:
            raise ValueError(f"Topology.rdma_latency_us={self.rdma_latency_us}: must be >= 0")
        if self.nvlink_GBps is not None and not self.nvlink_GBps > 0:
            raise ValueError(f"Topology.nvlink_GBps={self.nvlink_GBps}: must be > 0 (or None: fitted)")

    @property
    def hosts(self) -> int:
        return max(1, self.ranks // self.gpus_per_host)

    @property
    def same_host_peers(self) -> int:
        return min(self.ranks, self.gpus_per_host) - 1


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One measured exchange point (one wave, one host): medians in microseconds; None where not measured."""

    cfg: MoEConfig
    ranks: int
    tokens: int
    dispatch_us: float | None
    combine_us: float | None
    prepare_us: float | None = None
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class MoESample:
    """One measured MoE layer point (one host): the benchmark's kinds, in microseconds."""

    cfg: MoEConfig
    ranks: int
    tokens: int
    waves: int
    comm_only_us: float
    compute_only_us: float
    pipelined_us: float
    serial_us: float | None = None
    source: str = ""


# ----------------------------------------------------------------------------- traffic

def rows_per_token(num_experts: int, top_k: int, ranks: int, waves: int = 1) -> float:
    """Expected rows a token sends when its K distinct experts are drawn uniformly from E: one row per
    (peer, wave) cell it hits, each rank's E / P experts split into ``waves`` as ``WavePlan.expert_bounds``
    splits them (uneven where W does not divide E / P)."""
    if ranks < 1 or num_experts % ranks:
        raise ValueError(f"rows_per_token: ranks={ranks} must be >= 1 and divide num_experts={num_experts}")
    e = num_experts // ranks
    if not 1 <= waves <= e:
        raise ValueError(f"rows_per_token: waves={waves} must be in [1, {e}] (the local experts)")
    rows = 0.0
    for w in range(waves):
        size, miss = (w + 1) * e // waves - w * e // waves, 1.0
        for i in range(top_k):
            miss *= max(0.0, (num_experts - size - i) / (num_experts - i))
        rows += 1.0 - miss
    return ranks * rows


def effective_waves(cfg: MoEConfig, ranks: int, waves: int) -> int:
    """W clamped to the local experts (as ``WavePlan.make`` does for the experts partition)."""
    return max(1, min(waves, cfg.num_experts // ranks))


def traffic_MB(cfg: MoEConfig, topo: Topology, tokens: int, waves: int, op: str) -> tuple[float, float]:
    """(NVLink MB, RDMA MB) one rank sends in ONE wave's dispatch or combine (``op``)."""
    P, W = topo.ranks, effective_waves(cfg, topo.ranks, waves)
    if P == 1:
        return 0.0, 0.0
    row = cfg.hidden_size * BYTES_PER_ELEMENT + (cfg.top_k * META_BYTES_PER_SLOT if op == "dispatch" else 0)
    remote = tokens * rows_per_token(cfg.num_experts, cfg.top_k, P, W) / W * (P - 1) / P * row / 1e6
    nvl_share = topo.same_host_peers / (P - 1)
    return remote * nvl_share, remote * (1.0 - nvl_share)


def weight_GB(cfg: MoEConfig, ranks: int) -> float:
    """Expert weights one rank reads per layer: its e routed experts and the shared expert (gate, up, down)."""
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * BYTES_PER_ELEMENT
    return (cfg.num_experts // ranks + cfg.num_shared_experts) * per_expert / 1e9


def tflop(cfg: MoEConfig, tokens: int) -> float:
    """Expert FLOPs one rank does per layer under balanced routing: T K routed pairs (what P ranks send to it
    on average) and T shared-expert rows, 6 D I each."""
    return tokens * (cfg.top_k + cfg.num_shared_experts) * 6 * cfg.hidden_size * cfg.intermediate_size / 1e12


# ----------------------------------------------------------------------------- the fit

@dataclass(frozen=True)
class LinearFit:
    """y = sum_j values[j] * x[j]; ``status[j]`` is "fitted", "prior" (not identifiable from the points, kept at
    its prior) or "zero" (the fit went below 0: clamped)."""

    names: tuple[str, ...]
    values: tuple[float, ...]
    status: tuple[str, ...]
    points: int

    def predict(self, x) -> float:
        return float(np.dot(self.values, x))

    def __getitem__(self, name: str) -> float:
        return self.values[self.names.index(name)]


def fit_linear(names, X, y, prior, order=None) -> LinearFit:
    """Least squares on relative errors, |pred / y - 1|, with every value >= 0.

    Columns join the fit in ``order`` (default: as given) while they add rank to the columns already in; the
    others keep ``prior``. A negative solution is clamped to 0, most negative first, and the rest refitted.

    Args:
        names: k parameter names.
        X: [n, k] features; y: [n] measured values (> 0); prior: [k] values for what the points cannot fix.
    """
    X, y, prior = np.asarray(X, float).reshape(len(y), len(names)), np.asarray(y, float), np.asarray(prior, float)
    if len(prior) != len(names):
        raise ValueError(f"fit_linear: prior has {len(prior)} values for {len(names)} names")
    if len(y) and not (y > 0).all():
        raise ValueError(f"fit_linear: measured values must be > 0, got {y[y <= 0][:3].tolist()}")
    A = X / y[:, None] if len(y) else X
    status = ["prior"] * len(names)
    free: list[int] = []
    for j in (order if order is not None else range(len(names))):
        cand = free + [j]
        cols = A[:, cand]
        norms = np.linalg.norm(cols, axis=0)
        if len(y) >= len(cand) and (norms > 0).all():
            s = np.linalg.svd(cols / norms, compute_uv=False)
            if s[-1] > 1e-6 * s[0]:
                free = cand
    values = prior.copy()
    while free:
        held = [j for j in range(len(names)) if j not in free]
        rhs = np.ones(len(y)) - A[:, held] @ values[held]
        sol, *_ = np.linalg.lstsq(A[:, free], rhs, rcond=None)
        if (sol >= 0).all():
            values[free] = sol
            for j in free:
                status[j] = "fitted"
            break
        worst = free[int(np.argmin(sol))]
        values[worst], status[worst] = 0.0, "zero"
        free.remove(worst)
    return LinearFit(tuple(names), tuple(float(v) for v in values), tuple(status), len(y))


# priors: what a parameter is when the points cannot say (H200-class numbers)
COMM_TERMS = ("us_per_MB", "latency_us", "per_peer_us")
COMM_PRIOR = (1e3 / 300.0, 10.0, 1.0)             # 300 GB/s per GPU, 10 us per exchange, 1 us per peer
PREPARE_TERMS = ("latency_us", "per_peer_us")
PREPARE_PRIOR = (30.0, 1.0)
COMPUTE_TERMS = ("us_per_TFLOP", "us_per_GB", "per_wave_us", "fixed_us")
COMPUTE_PRIOR = (1e6 / 600.0, 1e6 / 4000.0, 30.0, 20.0)   # 600 TFLOP/s, 4 TB/s, 30 us a wave, 20 us
LAYER_COMM_TERMS = ("scale", "extra_us", "per_wave_us")
LAYER_COMM_PRIOR = (1.0, 0.0, 0.0)                        # the exchanges as the comm benchmark times them


def _comm_x(cfg, ranks, tokens, op) -> list[float]:
    nvl, _ = traffic_MB(cfg, Topology(ranks=ranks, gpus_per_host=max(ranks, 1)), tokens, 1, op)
    return [nvl, 1.0, ranks - 1.0]


def _compute_x(cfg, ranks, tokens, waves) -> list[float]:
    return [tflop(cfg, tokens), weight_GB(cfg, ranks), effective_waves(cfg, ranks, waves) - 1.0, 1.0]


def _fit_comm(samples, op: str) -> LinearFit:
    pts = [s for s in samples if getattr(s, f"{op}_us") is not None]
    y = [getattr(s, f"{op}_us") for s in pts]
    if op == "prepare":
        return fit_linear(PREPARE_TERMS, [[1.0, s.ranks - 1.0] for s in pts], y, PREPARE_PRIOR)
    return fit_linear(COMM_TERMS, [_comm_x(s.cfg, s.ranks, s.tokens, op) for s in pts], y, COMM_PRIOR)


def _fit_compute(samples) -> LinearFit:
    return fit_linear(COMPUTE_TERMS, [_compute_x(s.cfg, s.ranks, s.tokens, s.waves) for s in samples],
                      [s.compute_only_us for s in samples], COMPUTE_PRIOR)


def schedule_us(dispatch: list[float], experts: list[float], combine: list[float]) -> float:
    """Makespan of ``run_waves``' issue order on a comm stream and a compute stream (see the module docstring)."""
    W = len(experts)
    comm, comp, landed = 0.0, 0.0, {}
    for w in range(min(W, 2)):
        comm += dispatch[w]
        landed[w] = comm
    for w in range(W):
        comp = max(comp, landed.pop(w)) + experts[w]
        comm = max(comm, comp) + combine[w]
        if w + 2 < W:
            comm += dispatch[w + 2]
            landed[w + 2] = comm
    return comm


def replayed_us(comm_us: float, compute_us: float, waves: int) -> float:
    """The replayed makespan of a layer whose comm (count exchange included) is split evenly over its 2 W
    exchanges and whose compute is split evenly over its W waves: the same for a measured point (comm_only,
    compute_only) as for a projected one, so that ``unhidden`` means the same in the fit and in the projection."""
    d, c = comm_us / (2 * waves), compute_us / waves
    return schedule_us([d] * waves, [c] * waves, [d] * waves)


def _measured_schedule(s: MoESample) -> float:
    return replayed_us(s.comm_only_us, s.compute_only_us, effective_waves(s.cfg, s.ranks, s.waves))


def _fit_unhidden(samples) -> tuple[float, str]:
    """``unhidden`` from pipelined - schedule = unhidden (serial - schedule), relative errors, serial being
    comm_only + compute_only (what the replay hides is serial - schedule)."""
    num = den = 0.0
    for s in samples:
        sched = _measured_schedule(s)
        hidden = s.comm_only_us + s.compute_only_us - sched
        num += hidden * (s.pipelined_us - sched) / s.pipelined_us ** 2
        den += hidden * hidden / s.pipelined_us ** 2
    if den <= 0:
        return 0.0, "prior"
    return (num / den, "fitted") if num > 0 else (0.0, "zero")


# ----------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class Projection:
    """One projected point: per-layer times in microseconds. prepare, dispatch and combine (summed over the
    waves) as the comm benchmark would time them; comm_us all of them inside the layer (``layer_comm``)."""

    ranks: int
    hosts: int
    tokens: int
    waves: int
    nvlink_MB: float
    rdma_MB: float
    prepare_us: float
    dispatch_us: float
    combine_us: float
    comm_us: float
    compute_us: float
    serial_us: float
    pipelined_us: float


@dataclass(frozen=True)
class LayerCostModel:
    """The fitted terms (see the module docstring); build it with ``fit``."""

    dispatch: LinearFit
    combine: LinearFit
    prepare: LinearFit
    compute: LinearFit
    layer_comm: LinearFit
    unhidden: float
    unhidden_status: str = "prior"
    notes: tuple[str, ...] = field(default=())

    def exchange_us(self, op: str, cfg: MoEConfig, topo: Topology, tokens: int, waves: int) -> float:
        """One wave's dispatch or combine on one rank."""
        if topo.ranks == 1:
            return 0.0
        f = self.dispatch if op == "dispatch" else self.combine
        nvl, rdma = traffic_MB(cfg, topo, tokens, waves, op)
        us_per_MB = 1e3 / topo.nvlink_GBps if topo.nvlink_GBps else f["us_per_MB"]
        link = nvl * us_per_MB
        if rdma > 0:
            link = max(link, rdma * 1e3 / topo.rdma_GBps + topo.rdma_latency_us)
        return f["latency_us"] + f["per_peer_us"] * (topo.ranks - 1) + link

    def prepare_us(self, topo: Topology) -> float:
        if topo.ranks == 1:
            return 0.0
        extra = topo.rdma_latency_us if topo.ranks > topo.gpus_per_host else 0.0
        return self.prepare["latency_us"] + self.prepare["per_peer_us"] * (topo.ranks - 1) + extra

    def compute_us(self, cfg: MoEConfig, ranks: int, tokens: int, waves: int) -> float:
        return self.compute.predict(_compute_x(cfg, ranks, tokens, waves))

    def project(self, cfg: MoEConfig, topo: Topology, tokens: int, waves: int) -> Projection:
        """The layer at ``tokens`` per rank and ``waves`` waves (clamped to the local experts)."""
        if cfg.num_experts % topo.ranks:
            raise ValueError(f"ranks={topo.ranks}: must divide num_experts={cfg.num_experts}")
        if tokens < 0:
            raise ValueError(f"tokens={tokens}: must be >= 0")
        W = effective_waves(cfg, topo.ranks, waves)
        d = self.exchange_us("dispatch", cfg, topo, tokens, W)
        m = self.exchange_us("combine", cfg, topo, tokens, W)
        c = self.compute_us(cfg, topo.ranks, tokens, W)
        prep = self.prepare_us(topo)
        comm = self.layer_comm.predict([prep + W * (d + m), 1.0, W - 1.0]) if topo.ranks > 1 else 0.0
        nvl, rdma = traffic_MB(cfg, topo, tokens, W, "dispatch")
        return Projection(ranks=topo.ranks, hosts=topo.hosts, tokens=tokens, waves=W, nvlink_MB=nvl * W,
                          rdma_MB=rdma * W, prepare_us=prep, dispatch_us=d * W, combine_us=m * W, comm_us=comm,
                          compute_us=c, serial_us=comm + c, pipelined_us=self.pipelined_us(comm, c, W))

    def pipelined_us(self, comm_us: float, compute_us: float, waves: int) -> float:
        """The pipelined layer from its comm and compute: the replay, plus the unhidden share of what it hides."""
        sched = replayed_us(comm_us, compute_us, waves)
        return sched + self.unhidden * (comm_us + compute_us - sched)

    def best(self, cfg: MoEConfig, topo: Topology, tokens: int, waves=(1, 2, 4, 8)) -> Projection:
        """The projection with the lowest pipelined time over ``waves`` (ties to the smaller W)."""
        return min((self.project(cfg, topo, tokens, W) for W in sorted(set(waves))),
                   key=lambda p: (round(p.pipelined_us, 6), p.waves))


def fit(comm: list[CommSample], moe: list[MoESample]) -> LayerCostModel:
    """Fit every term on the measured points (either list may be empty: its terms keep their priors)."""
    k, how = _fit_unhidden(moe)
    notes = []
    if len({s.ranks for s in comm}) < 2:
        notes.append("every comm point has the same EP size: per_peer_us is its prior")
    prior = LinearFit(LAYER_COMM_TERMS, LAYER_COMM_PRIOR, ("prior",) * 3, 0)
    model = LayerCostModel(dispatch=_fit_comm(comm, "dispatch"), combine=_fit_comm(comm, "combine"),
                      prepare=_fit_comm(comm, "prepare"), compute=_fit_compute(moe), layer_comm=prior, unhidden=k,
                      unhidden_status=how, notes=tuple(notes))
    # the exchanges of each MoE point as the comm terms see them, then the layer's comm fitted on them
    X = [[model.project(s.cfg, Topology(ranks=s.ranks, gpus_per_host=s.ranks), s.tokens, s.waves).comm_us, 1.0,
          effective_waves(s.cfg, s.ranks, s.waves) - 1.0] for s in moe if s.ranks > 1]
    y = [s.comm_only_us for s in moe if s.ranks > 1]
    return replace(model, layer_comm=fit_linear(LAYER_COMM_TERMS, X, y, LAYER_COMM_PRIOR))


# ----------------------------------------------------------------------------- errors on unseen points

QUANTITIES = ("dispatch", "combine", "compute", "pipelined", "comm_only")


def _predict(model: LayerCostModel, s, what: str) -> float:
    topo = Topology(ranks=s.ranks, gpus_per_host=s.ranks)
    if what in ("dispatch", "combine"):
        return model.exchange_us(what, s.cfg, topo, s.tokens, 1)
    p = model.project(s.cfg, topo, s.tokens, s.waves)
    if what == "compute":
        return p.compute_us
    if what == "comm_only":
        return p.comm_us
    # pipelined: the unhidden term on the measured comm and compute, so that its error is its own
    return model.pipelined_us(s.comm_only_us, s.compute_only_us, effective_waves(s.cfg, s.ranks, s.waves))


def _measured(s, what: str) -> float | None:
    return {"dispatch": getattr(s, "dispatch_us", None), "combine": getattr(s, "combine_us", None),
            "compute": getattr(s, "compute_only_us", None), "pipelined": getattr(s, "pipelined_us", None),
            "comm_only": getattr(s, "comm_only_us", None)}[what]


@dataclass(frozen=True)
class Error:
    """A prediction for a point the fit did not see: ``rel`` = predicted / measured - 1."""

    what: str
    sample: object
    predicted: float
    measured: float

    @property
    def rel(self) -> float:
        return self.predicted / self.measured - 1.0


def leave_one_out(comm: list[CommSample], moe: list[MoESample]) -> list[Error]:
    """Each point predicted by a fit on all the others: a comm point's dispatch and combine, a MoE point's
    compute, comm_only and pipelined."""
    out = []
    for i, s in enumerate(comm):
        model = fit(comm[:i] + comm[i + 1:], moe)
        out += [Error(q, s, _predict(model, s, q), _measured(s, q)) for q in ("dispatch", "combine")
                if _measured(s, q)]
    for i, s in enumerate(moe):
        model = fit(comm, moe[:i] + moe[i + 1:])
        out += [Error(q, s, _predict(model, s, q), _measured(s, q)) for q in ("compute", "comm_only", "pipelined")]
    return out


def held_out(comm: list[CommSample], moe: list[MoESample], test_ranks: int) -> list[Error]:
    """Every point at ``test_ranks`` predicted by a fit on the points at other EP sizes only."""
    model = fit([s for s in comm if s.ranks != test_ranks], [s for s in moe if s.ranks != test_ranks])
    out = [Error(q, s, _predict(model, s, q), _measured(s, q)) for s in comm if s.ranks == test_ranks
           for q in ("dispatch", "combine") if _measured(s, q)]
    out += [Error(q, s, _predict(model, s, q), _measured(s, q)) for s in moe if s.ranks == test_ranks
            for q in ("compute", "pipelined", "comm_only")]
    return out


def summarize(errors: list[Error]) -> dict[str, dict]:
    """Per quantity: points, median and largest |relative error|."""
    out = {}
    for q in QUANTITIES:
        rel = sorted(abs(e.rel) for e in errors if e.what == q)
        if rel:
            out[q] = {"points": len(rel), "median": rel[len(rel) // 2] if len(rel) % 2 else
                      (rel[len(rel) // 2 - 1] + rel[len(rel) // 2]) / 2, "max": rel[-1]}
    return out

