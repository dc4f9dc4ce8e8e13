"""Measurement core: one benchmark point of a ``WaveMoE``.

Legend: T local tokens, D hidden, K top-k, P ranks, W waves, R received rows.

What is timed (every rank runs the same iterations; medians per rank, then the max over ranks):

    serial_us        forward_routed(overlap=False): layout + count exchange + W x (dispatch -> experts
                     -> combine) one after another + the shared expert after them
    pipelined_us     forward_routed(overlap=True): the wave pipeline, shared expert per its placement
    comm_only_us     layout + count exchange + every wave's dispatch and combine in pipeline order, the
                     experts replaced by an identity that returns the received rows (no shared expert)
    compute_only_us  the routed experts on every wave's pre-received rows + the whole shared expert,
                     no communication, no router, no layout
    ideal_us         max(comm_only, compute_only)
    exposed_us       pipelined - compute_only (everything the pipeline failed to hide, host sync included)
    overlap_ratio    1 - exposed / comm_only (1: all comm hidden; <= 0: nothing hidden)
    GBps             link_bytes / comm_only, link_bytes = bytes this rank sends to other ranks (dispatch
                     rows + their routing metadata, combine rows back), max over ranks

Routing is computed once per input outside the timed region. Inputs rotate through a pool of
pre-generated random tensors (never zeros); on GPU a 256 MB buffer is written before every iteration
to flush L2, the ranks meet at a barrier, and CUDA events time the iteration. On CPU
``time.perf_counter`` does. Before timing, ``check`` compares pipelined with serial (allclose).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from moe_wave.comm.backend import Received
from moe_wave.comm.layout import compute_layout
from moe_wave.moe import WaveMoE
from moe_wave.probe import comm_only as _comm_only
from moe_wave.probe import pre_receive as _pre_receive
from moe_wave.probe import routed_only
from moe_wave.profiling import annotate
from moe_wave.timing import align, as_graph, iteration_us, l2_flush_buffer, slowest

__all__ = ["BenchConfig", "measure", "init_random_", "random_inputs", "comm_only", "pre_receive", "compute_only",
           "link_bytes", "derive", "KINDS"]

KINDS = ("serial", "pipelined", "comm_only", "compute_only")
_POOL_BYTES = 2 << 30  # cap on the pool of inputs + pre-received rows per rank
_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (1e-2, 1e-2)}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """How one point is measured.

    Attributes:
        warmup: untimed iterations per kind.
        iters: timed iterations per kind (the median is reported).
        pool: distinct random inputs rotated through (reduced to fit ``_POOL_BYTES``).
        flush_l2: write a 256 MB buffer before every iteration (GPU only).
        seed: of the inputs (each rank adds its rank).
        graph: capture each kind in a CUDA graph and time its replays (GPU, sync-free backends
            such as ``symm`` only): what the schedule costs on the device once the host is out of
            the loop. The graph replays one static input (L2 still flushed between replays).
    """

    warmup: int = 3
    iters: int = 20
    pool: int = 4
    flush_l2: bool = True
    seed: int = 0
    graph: bool = False

    def __post_init__(self):
        if self.warmup < 0:
            raise ValueError(f"BenchConfig.warmup={self.warmup}: must be >= 0")
        for name in ("iters", "pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name}={getattr(self, name)}: must be >= 1")


# ----------------------------------------------------------------------------- setup helpers

@torch.no_grad()
def init_random_(moe: WaveMoE, seed: int = 0) -> WaveMoE:
    """Random weights drawn on the parameters' device (no full-weight copy on the host, so V4-Pro
    fits): router identical on every rank, experts per rank; scaled to keep activations O(1)."""
    dev = moe.gate.weight.device
    rank = moe.ep.rank

    def fill(t: torch.Tensor, fan_in: int, s: int) -> None:
        g = torch.Generator(device=dev).manual_seed(s)
        t.copy_(torch.randn(t.shape, generator=g, device=dev, dtype=torch.float32).mul_(fan_in ** -0.5))

    D, I = moe.cfg.hidden_size, moe.cfg.intermediate_size
    fill(moe.gate.weight, D, seed)
    for j in range(moe.num_local):  # one expert at a time: no fp32 copy of all experts at once
        fill(moe.experts.gate_up[j], D, seed + 1000 * (rank + 1) + 2 * j)
        fill(moe.experts.down[j], I, seed + 1000 * (rank + 1) + 2 * j + 1)
    if moe.shared is not None:
        fill(moe.shared.gate_proj, D, seed + 1)
        fill(moe.shared.up_proj, D, seed + 2)
        fill(moe.shared.down_proj, I, seed + 3)
    return moe


def random_inputs(moe: WaveMoE, tokens: int, n: int, seed: int = 0) -> list[tuple]:
    """``n`` random (x_TD, ids_TK, w_TK): x ~ N(0, 1) in the parameter dtype, routed by the model."""
    dev, dtype = moe.gate.weight.device, moe.gate.weight.dtype
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + moe.ep.rank)
    out = []
    with torch.no_grad():
        for _ in range(n):
            x_TD = torch.randn(tokens, moe.cfg.hidden_size, generator=g, device=dev, dtype=torch.float32).to(dtype)
            if moe.cfg.hash_routing:
                ids = torch.randint(moe.cfg.vocab_size, (tokens,), generator=g, device=dev)
                out.append((x_TD, *moe.route(x_TD, ids)))
            else:
                out.append((x_TD, *moe.route(x_TD)))
    return out


# ----------------------------------------------------------------------------- the kinds without the pipeline

def comm_only(moe: WaveMoE, x_TD, ids_TK, w_TK) -> torch.Tensor:
    """Layout, count exchange, every wave's dispatch and combine of the rows the layer sends (``WaveMoE.wire``:
    FP8 rows included, their packing too); no expert compute (``moe_wave.probe``)."""
    x_send, width = moe.wire(x_TD)
    return _comm_only(moe.backend, x_send, ids_TK, w_TK, moe.plan, width)


def pre_receive(moe: WaveMoE, x_TD, ids_TK, w_TK) -> list[Received]:
    """Every wave's received rows under ``moe.plan`` as the layer sends them (copied out of the backend's
    buffers)."""
    x_send, width = moe.wire(x_TD)
    return _pre_receive(moe.backend, x_send, ids_TK, w_TK, moe.plan, width)


def compute_only(moe: WaveMoE, x_TD, received: list[Received]) -> None:
    """The routed experts on every wave's received rows (on the pipeline's expert streams), then the shared
    expert; no comm."""
    routed_only(moe.routed_rows, received, moe.streams.extra[:moe.wave.expert_streams - 1])
    if moe.shared is not None:
        with annotate("shared.serial"):
            moe.shared(x_TD)


def link_bytes(moe: WaveMoE, x_TD, ids_TK, w_TK) -> int:
    """Bytes this rank sends to other ranks in one layer: dispatch rows (+ K int32 expert ids and
    K fp32 weights each) and combine rows back."""
    layout = compute_layout(ids_TK, w_TK, moe.plan)
    xplan = moe.backend.prepare(layout)
    me = moe.ep.rank
    # HOST SYNC (setup only): row counts for the byte total.
    sent = int(layout.send_counts_WP.sum() - layout.send_counts_WP[:, me].sum())
    recv = int(xplan.recv_counts_WP.sum() - xplan.recv_counts_WP[:, me].sum())
    row = moe.cfg.hidden_size * x_TD.element_size()
    return sent * (row + 8 * moe.cfg.top_k) + recv * row


def _pool_size(moe: WaveMoE, tokens: int, want: int) -> int:
    P, K = moe.ep.size, moe.cfg.top_k
    per = tokens * moe.cfg.hidden_size * moe.gate.weight.element_size() * (1 + min(K, P))
    return max(1, min(want, _POOL_BYTES // max(per, 1)))


# ----------------------------------------------------------------------------- one point

@torch.no_grad()
def measure(moe: WaveMoE, tokens: int, bench: BenchConfig | None = None, kinds=KINDS, tracer=None,
            label: str = "point") -> dict:
    """Measure one point. Every rank of ``moe.ep`` must call it together with the same arguments
    (``tokens`` may differ between ranks). Returns the same dict on every rank: ``<kind>_us`` for
    each of ``kinds`` (max over ranks of the per-rank medians), and when all four kinds are timed
    ``ideal_us``, ``exposed_us``, ``overlap_ratio``, ``link_bytes``, ``GBps``, ``speedup`` (serial /
    pipelined), plus always ``check`` ("ok" or "FAIL") and ``max_err`` (pipelined vs serial).
    With a ``moe_wave.tools.trace.Tracer``, one more iteration of each kind is recorded under ``label``."""
    bench = bench or BenchConfig()
    ep, cuda = moe.ep, moe.ep.device.type == "cuda"
    flush = l2_flush_buffer(ep.device) if bench.flush_l2 else None
    inputs = random_inputs(moe, tokens, _pool_size(moe, tokens, bench.pool), bench.seed)
    n = len(inputs)

    x0, ids0, w0 = inputs[0]
    y_pipe = moe.forward_routed(x0, ids0, w0, overlap=True)  # also resolves an "auto" wave count
    y_ser = moe.forward_routed(x0, ids0, w0, overlap=False)
    if bench.graph:
        if not cuda:
            raise ValueError("BenchConfig.graph=True: CUDA graphs need a CUDA device")
        inputs, n = inputs[:1], 1        # a graph replays its captured (static) input
        graphs = {k: as_graph(f, x0.device) for k, f in (
            ("serial", lambda i: moe.forward_routed(x0, ids0, w0, overlap=False)),
            ("pipelined", lambda i: moe.forward_routed(x0, ids0, w0, overlap=True)))}
        graphs["serial"][0](0)
        graphs["pipelined"][0](0)
        y_ser, y_pipe = graphs["serial"][1], graphs["pipelined"][1]
    rtol, atol = _TOL.get(x0.dtype, (1e-2, 1e-2))
    scale = max(float(y_ser.float().abs().max()), 1e-6) if tokens else 1.0
    err = float((y_pipe.float() - y_ser.float()).abs().max()) if tokens else 0.0
    ok = torch.allclose(y_pipe.float(), y_ser.float(), rtol=rtol, atol=atol * scale)

    fns = {
        "serial": lambda i: moe.forward_routed(*inputs[i % n], overlap=False),
        "pipelined": lambda i: moe.forward_routed(*inputs[i % n], overlap=True),
        "comm_only": lambda i: comm_only(moe, *inputs[i % n]),
    }
    if "compute_only" in kinds:
        received = [pre_receive(moe, *inp) for inp in inputs]
        fns["compute_only"] = lambda i: compute_only(moe, inputs[i % n][0], received[i % n])
    if bench.graph:
        fns = {k: (graphs[k][0] if k in graphs else as_graph(f, x0.device)[0]) for k, f in fns.items()}
    medians = []
    for kind in kinds:
        with annotate(f"bench.{kind}"):
            medians.append(statistics.median(iteration_us(fns[kind], bench.iters, bench.warmup, ep=ep, flush=flush)))
    if tracer is not None and tracer.enabled:
        align(ep)
        with tracer.capture(label):
            if not moe.cfg.hash_routing:  # the router is outside the timed kinds; one call shows it on the timeline
                moe.route(x0)
            for kind in kinds:
                with annotate(f"bench.{kind}"):
                    fns[kind](0)
    nbytes = link_bytes(moe, x0, ids0, w0) if "comm_only" in kinds else 0
    agg = slowest(ep, medians + [err, 0.0 if ok else 1.0, float(nbytes)])
    row = {f"{k}_us": round(v, 2) for k, v in zip(kinds, agg)}
    err, bad, nbytes = agg[len(kinds):]
    row.update(check="FAIL" if bad else "ok", max_err=float(f"{err:.3g}"))
    if set(KINDS) <= set(kinds):
        row.update(derive(row["serial_us"], row["pipelined_us"], row["comm_only_us"], row["compute_only_us"]))
        row["link_bytes"] = int(nbytes)
        row["GBps"] = round(nbytes / (row["comm_only_us"] * 1e3), 2) if row["comm_only_us"] > 0 else 0.0
    return row


def derive(serial_us: float, pipelined_us: float, comm_us: float, compute_us: float) -> dict:
    """ideal, exposed comm, overlap ratio and speedup from the four medians (see the module docstring)."""
    exposed = pipelined_us - compute_us
    return {"ideal_us": round(max(comm_us, compute_us), 2), "exposed_us": round(exposed, 2),
            "overlap_ratio": round(1.0 - exposed / comm_us, 4) if comm_us > 0 else 0.0,
            "speedup": round(serial_us / pipelined_us, 4) if pipelined_us > 0 else 0.0}
