"""What every section of the communication benchmark shares: its settings, the run (timing, the GEMM
baseline, the P2P limit, rows saved as they come), the token layouts and the backends.

Legend: T tokens per rank, D hidden, K top-k, E experts, P ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from moe_wave import MoEConfig
from moe_wave.comm import EPGroup
from moe_wave.comm import streams as st
from moe_wave.comm.deepep import MAX_LOCAL_EXPERTS
from moe_wave.comm.factory import make_backend
from moe_wave.comm.layout import WavePlan, compute_layout
from moe_wave.comm.options import SymmOptions
from moe_wave.timing import median_us, paired_us

__all__ = ["LAYOUTS", "MB", "SECTIONS", "DEFAULT_SECTIONS", "Settings", "Run", "beside", "beside_gemm", "token_case",
           "token_cases", "backend", "deepep_skip", "symm_alloc"]

LAYOUTS = {"v4-flash": (4096, 256, 6), "v4-pro": (7168, 384, 6)}   # D, E, K
MB = 1 << 20
SECTIONS = ("bytes", "tokens", "graph", "tune", "moe", "vdev")
DEFAULT_SECTIONS = ("bytes", "tokens", "graph", "moe")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One run's settings (``benchmarks/bench_comm.py``'s flags).

    Attributes:
        quick: few sizes and token counts.
        iters: timed samples per point (their median is reported).
        reps: back-to-back calls per sample.
        carveout: SMs the GEMM leaves free in the carve-out rows (0: none).
        graphs: also the rows replayed from CUDA graphs.
        memops: also the bytes all-to-all closed by stream memory operations.
        sections: which sections run, in ``SECTIONS`` order.
        backends: the comm backends of the token and moe sections.
        out: where the JSON goes (rank 0), or None.
    """

    quick: bool = False
    iters: int = 20
    reps: int = 10
    carveout: int = 16
    graphs: bool = True
    memops: bool = False
    sections: tuple = DEFAULT_SECTIONS
    backends: tuple = ("torch", "symm")
    out: str | None = None

    def __post_init__(self):
        bad = [s for s in self.sections if s not in SECTIONS]
        if bad:
            raise ValueError(f"Settings.sections={self.sections}: unknown {bad}; choose from {','.join(SECTIONS)}")
        for name in ("iters", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Settings.{name}={getattr(self, name)}: must be >= 1")
        if self.carveout < 0:
            raise ValueError(f"Settings.carveout={self.carveout}: must be >= 0 (0: no carve-out rows)")

    @property
    def sizes(self) -> list[int]:
        """Bytes per rank of the bytes all-to-all."""
        return [MB, 16 * MB, 64 * MB] + ([] if self.quick else [256 * MB, 1024 * MB])

    @property
    def tokens(self) -> list[int]:
        return [128, 4096] if self.quick else [128, 512, 2048, 4096, 8192]


class Run:
    """One benchmark run: the group, the settings, the GEMM every exchange runs beside, the rows so far.

    Every rank calls every method together (the timings align the ranks); only rank 0 prints and writes."""

    def __init__(self, ep: EPGroup, settings: Settings, meta: dict):
        self.ep, self.s, self.meta = ep, settings, meta
        self.rows: list[dict] = []      # the finished sections'
        self.gemm = gemm_fn()
        self.gemm_us = self.timed(self.gemm)
        self.p2p = 0.0                  # GB/s per direction, set by main once measured

    def timed(self, fn, iters: int | None = None) -> float:
        """Median microseconds per fn() call, slowest rank (``moe_wave.timing.median_us``)."""
        return median_us(fn, iters or self.s.iters, warmup=3, reps=self.s.reps, ep=self.ep)

    def pair(self, base, fn) -> tuple:
        """(base us, fn us, fn - base us) sampled in turns (``moe_wave.timing.paired_us``)."""
        return paired_us(base, fn, self.s.iters, warmup=3, reps=self.s.reps, ep=self.ep)

    def log(self, msg: str) -> None:
        if self.ep.rank == 0:
            print(f"[bench_comm] {msg}", flush=True)

    def save(self, partial=()) -> None:
        """Write the finished sections' rows and ``partial`` (rank 0), so a run cut short leaves its rows."""
        if self.ep.rank == 0 and self.s.out:
            with open(self.s.out, "w") as f:
                json.dump({"meta": self.meta, "rows": self.rows + list(partial)}, f, indent=1)

    def add(self, rows: list) -> None:
        """A section's rows are done."""
        self.rows += rows
        self.save()


def gemm_fn(n: int = 4096, k: int = 7168):
    """The ~300 us bf16 GEMM on cuBLASLt: torch's SM carve-out (``_set_sm_carveout_experimental``) only
    reaches cuBLASLt (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), so every GEMM here, carved or not, uses it."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def beside(comm_fn, gemm):
    """comm_fn on a side stream (its backend's streams behind it) while the GEMM runs on this one."""
    side = torch.cuda.Stream()

    def run():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            comm_fn()
        gemm()
        cur.wait_stream(side)
    return run


def beside_gemm(run: Run, rt, carveout: int | None = None, also: dict | None = None) -> dict:
    """rt beside the GEMM (and each of ``also``: ``beside_gemm_<name>_us``), then beside the GEMM with
    ``carveout`` (default ``Settings.carveout``) SMs left free (as DeepEP reserves SMs for its own kernels),
    where torch can carve them out. Beside the whole GEMM, samples alternate with the GEMM alone
    (``Run.pair``: ``exposed_us`` is the median of the paired differences, ``gemm_row_us`` the GEMM's
    median); the carved GEMM alone is timed too, and the carved rows still count against the whole GEMM:
    the carve-out's own cost is not forgiven."""
    carveout = run.s.carveout if carveout is None else carveout
    g, b, d = run.pair(run.gemm, beside(rt, run.gemm))
    row = dict(gemm_row_us=g, beside_gemm_us=b, exposed_us=d, gemm_us=run.gemm_us)
    for name, fn in (also or {}).items():     # before any carve-out: once lifted, the GEMM can run slower
        _, row[f"beside_gemm_{name}_us"], row[f"exposed_{name}_us"] = run.pair(run.gemm, beside(fn, run.gemm))
    if carveout and hasattr(torch._C, "_set_sm_carveout_experimental"):
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            row.update(carveout_sms=carveout, gemm_carveout_us=run.timed(run.gemm),
                       beside_gemm_carveout_us=run.timed(beside(rt, run.gemm)))
        finally:
            torch._C._set_sm_carveout_experimental(None)
        row["gemm_after_carveout_us"] = run.timed(run.gemm)    # is the GEMM as fast again once lifted?
    return row


def symm_alloc(ep: EPGroup, nbytes: int):
    """A zeroed symmetric-memory byte buffer and its handle (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
    hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
    buf.zero_()
    return buf, hdl


def token_case(ep: EPGroup, g, D: int, E: int, K: int, T: int):
    """Random bf16 tokens and uniform top-K routing of T tokens: (x, layout, rows sent, MoEConfig)."""
    x = torch.randn(T, D, device=ep.device, dtype=torch.bfloat16, generator=g)
    ids = torch.argsort(torch.rand(T, E, device=ep.device, generator=g), 1)[:, :K]
    w = torch.rand(T, K, device=ep.device, generator=g)
    plan = WavePlan.make(num_ranks=ep.size, num_local_experts=E // ep.size, num_waves=1)
    layout = compute_layout(ids, w, plan)
    sent = int(layout.send_counts_WP.sum())          # HOST SYNC: outside the timed region
    return x, layout, sent, MoEConfig(hidden_size=D, intermediate_size=256, num_experts=E, top_k=K)


def token_cases(ep: EPGroup, layouts, tokens, seed: int):
    """(layout name, D, T, x, layout, rows sent, MoEConfig) for every layout and token count, one generator."""
    g = torch.Generator(device=ep.device).manual_seed(seed + ep.rank)
    for lname in layouts:
        D, E, K = LAYOUTS[lname]
        for T in tokens:
            yield (lname, D, T) + token_case(ep, g, D, E, K, T)


def backend(ep: EPGroup, name: str, cfg: MoEConfig, symm: SymmOptions | None = None):
    """A fresh backend ``name`` on its own streams (``symm``: these options, default capacity)."""
    return make_backend(name, ep, st.Streams.for_device(ep.device).comm, symm=symm or SymmOptions(),
                        hidden_size=cfg.hidden_size)


def deepep_skip(num_experts: int, ep: EPGroup) -> str | None:
    """Why DeepEP cannot run a layout on this group, or None."""
    local = num_experts // ep.size
    if local > MAX_LOCAL_EXPERTS:
        return (f"DeepEP V1 supports at most {MAX_LOCAL_EXPERTS} experts per rank; {num_experts} experts on "
                f"{ep.size} ranks is {local}")
    return None
