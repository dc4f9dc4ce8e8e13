"""Section "bytes": the P2P copy limit and an all-to-all of B bytes per rank, NCCL against symmetric memory.

Legend: P ranks, n bf16 elements per rank, chunk = n / P elements per peer, B = 2n bytes per rank.

The symmetric-memory all-to-all copies each peer's chunk into that peer's buffer with the copy engines
(``Tensor.copy_`` into peer memory) and closes the exchange with torch's barrier kernel ("symm"), with
completion flags the copy engines write after the data ("symm-flags", ``comm.symm_signal``) or with stream
memory operations ("symm-memops", ``comm.symm_memops``). Every variant's received bytes are checked against
NCCL's ``all_to_all_single`` of the same input before it is timed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_wave.comm import EPGroup
from moe_wave.comm.symm_memops import MemopSignal
from moe_wave.comm.symm_signal import CopySignal
from moe_wave.timing import as_graph

from .common import MB, Run, beside_gemm, symm_alloc

__all__ = ["p2p_limit", "bytes_rows", "Exchange"]

TIMEOUT_MS = 120_000


def p2p_limit(run: Run, nbytes: int) -> float:
    """GB/s of one large copy into the next rank's GPU (copy engine), per direction."""
    import torch.distributed._symmetric_memory as symm_mem

    ep = run.ep
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=ep.device)
    hdl = symm_mem.rendezvous(buf, ep.pg.group_name)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=ep.device)
    peer = hdl.get_buffer((ep.rank + 1) % ep.size, [nbytes], torch.uint8, 0)
    us = run.timed(lambda: peer.copy_(src, non_blocking=True), 10)
    hdl.barrier(channel=0)
    return nbytes / us / 1e3


class Exchange:
    """One all-to-all of ``nbytes`` per rank: the input, NCCL's output, the symmetric receive buffer, and
    each way of moving it (methods of no arguments, as the timings call them)."""

    def __init__(self, ep: EPGroup, nbytes: int, memops: bool):
        import torch.distributed._symmetric_memory as symm_mem

        P, me = ep.size, ep.rank
        self.ep, self.n = ep, nbytes // 2 // P * P
        self.x = torch.randn(self.n, device=ep.device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.x)
        self.buf = symm_mem.empty(self.n, dtype=torch.bfloat16, device=ep.device)
        self.hdl = symm_mem.rendezvous(self.buf, ep.pg.group_name)
        chunk = self.n // P
        self.peers = [self.hdl.get_buffer(p, [P, chunk], torch.bfloat16, 0) for p in range(P)]
        self.xs = self.x.view(P, chunk)
        self.loc, self.other = torch.cuda.Stream(), torch.cuda.Stream()
        self.nxt, self.src_n, self.half = self.peers[(me + 1) % P][me], self.xs[(me + 1) % P], chunk // 2
        # [poison, peer, call]: where a signal records a peer that did not arrive (``check_fault``)
        self.fault = torch.zeros(3, dtype=torch.int64, device=ep.device)
        self.flags = CopySignal(ep, lambda nb: symm_alloc(ep, nb), TIMEOUT_MS, self.fault)
        self.mem = (MemopSignal(ep, lambda nb: symm_alloc(ep, nb), timeout_ms=TIMEOUT_MS, fault=self.fault)
                    if memops else None)

    @property
    def nbytes(self) -> int:
        return self.n * 2

    def nccl(self) -> None:
        dist.all_to_all_single(self.out, self.x, group=self.ep.pg)

    def symm(self) -> None:
        """One stream (eager: a second stream for the local block measured slower, host work)."""
        me = self.ep.rank
        for p in range(self.ep.size):
            self.peers[p][me].copy_(self.xs[p], non_blocking=True)
        self.hdl.barrier(channel=0)

    def copies(self) -> None:
        """The copies into the other ranks alone (no local block, no barrier)."""
        me = self.ep.rank
        for p in range(self.ep.size):
            if p != me:
                self.peers[p][me].copy_(self.xs[p], non_blocking=True)

    def _start_local(self, sm: bool = False) -> None:
        """This rank's own block on a second stream, beside the NVLink copies (by the SMs with ``sm``)."""
        me = self.ep.rank
        self.loc.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.loc):
            if sm:
                torch.mul(self.xs[me], 1, out=self.peers[me][me])
            else:
                self.peers[me][me].copy_(self.xs[me], non_blocking=True)

    def _join_local(self) -> None:
        torch.cuda.current_stream().wait_stream(self.loc)

    def symm2(self) -> None:
        """For the graph: the local block on a second stream, beside the NVLink copies, then the barrier."""
        self._start_local()
        self.copies()
        self._join_local()
        self.hdl.barrier(channel=0)

    def smlocal(self) -> None:
        self._start_local(sm=True)
        self.copies()
        self._join_local()
        self.hdl.barrier(channel=0)

    def nolocal(self) -> None:
        """symm2 without this rank's own block: is the local copy on the critical path?"""
        self.copies()
        self.hdl.barrier(channel=0)

    def closed_by(self, sig):
        """symm2 with ``sig.begin()`` / ``sig.end()`` around the copies instead of the barrier kernel (the
        signal does not wait for the local block)."""
        def run():
            sig.begin()
            self._start_local()
            self.copies()
            sig.end()
            self._join_local()
        return run

    def p2p_copy(self) -> None:
        self.nxt.copy_(self.src_n, non_blocking=True)

    def copy2(self) -> None:
        """The bytes that cross into the next rank as two copies on two streams (two copy engines?)."""
        cur, h = torch.cuda.current_stream(), self.half
        self.other.wait_stream(cur)
        with torch.cuda.stream(self.other):
            self.nxt[h:].copy_(self.src_n[h:], non_blocking=True)
        self.nxt[:h].copy_(self.src_n[:h], non_blocking=True)
        cur.wait_stream(self.other)

    def check_fault(self) -> None:
        """Raise if a signal gave up waiting for a peer (HOST SYNC: after the size's rows, untimed)."""
        poison, peer, call = self.fault.tolist()
        if poison:
            raise RuntimeError(f"bytes all-to-all {self.nbytes / MB:.0f} MB: rank {self.ep.rank} gave up waiting "
                               f"for rank {peer} (exchange call {call}) after {TIMEOUT_MS} ms")
        if self.mem is not None:
            self.mem.check()

    def verify(self, run: Run, name: str, fn) -> None:
        """What ``fn`` delivers equals NCCL's all-to-all of the same input (HOST SYNC: setup, untimed)."""
        self.x.normal_()
        for step in (lambda: self.buf.fill_(float("nan")), fn, self.nccl):
            torch.cuda.synchronize()
            dist.barrier(group=self.ep.pg)
            step()
        torch.cuda.synchronize()
        if not torch.equal(self.buf, self.out):
            raise RuntimeError(f"bytes all-to-all {name} at {self.nbytes / MB:.0f} MB: the received bytes differ "
                               f"from NCCL's all_to_all_single of the same input")
        run.log(f"{name} {self.nbytes / MB:.0f} MB: received bytes equal NCCL's")


def _graph(ex: Exchange, fn):
    return as_graph(lambda i: fn(), ex.ep.device)[0]


def _memops_cases(run: Run, ex: Exchange) -> list:
    """The exchange closed by stream memory operations, eager and (where the driver captures them) graphed."""
    fn = ex.closed_by(ex.mem)
    ex.verify(run, "symm-memops", fn)
    cases = [("symm-memops", False, fn)]
    if run.s.graphs:
        try:
            g = _graph(ex, fn)
            ex.verify(run, "symm-memops[g]", lambda: g(0))
            cases.append(("symm-memops", True, g))
        except RuntimeError as e:    # the driver may not capture stream memory operations
            run.log(f"symm-memops: no CUDA graph: {e}")
    return cases


def _cases(run: Run, ex: Exchange) -> list:
    """(backend, graph, fn) to time; ``--memops --sections bytes`` keeps the memops rows and the graph
    baselines only."""
    cases = [("torch", False, ex.nccl), ("symm", False, ex.symm)]
    ex.verify(run, "symm", ex.symm)
    if ex.mem is not None:
        cases += _memops_cases(run, ex)
    if _memops_only(run):
        return [c for c in cases if c[0] == "symm-memops"] + _baselines(ex)
    if run.s.graphs:   # each replayed from a CUDA graph: no host work, the bandwidth itself
        cases += _baselines(ex) + [("symm-flags", True, _graph(ex, ex.closed_by(ex.flags)))]
    return cases


def _memops_only(run: Run) -> bool:
    return run.s.memops and run.s.sections == ("bytes",)


def _baselines(ex: Exchange) -> list:
    return [("torch", True, _graph(ex, ex.nccl)), ("symm", True, _graph(ex, ex.symm2))]


def _diag_rows(run: Run, ex: Exchange) -> list:
    """Where the fixed cost goes, each replayed from a CUDA graph: one plain copy into the next rank (and
    the same as two), the copies alone, the barrier alone, without the local block, the local block by SMs."""
    rows = []
    for name, f in (("p2p-copy", ex.p2p_copy), ("p2p-copy2", ex.copy2), ("symm-copies", ex.copies),
                    ("symm-barrier", lambda: ex.hdl.barrier(channel=0)), ("symm-nolocal", ex.nolocal),
                    ("symm-smlocal", ex.smlocal)):
        g = _graph(ex, f)
        rows.append(dict(backend=name, graph=True, layout="bytes", diag=True, tokens_per_rank=0,
                         bytes_per_rank=ex.nbytes, alone_us=run.timed(lambda: g(0)), p2p_limit_GBps=run.p2p))
        ex.hdl.barrier(channel=0)
    return rows


def _size_rows(run: Run, nbytes: int) -> list:
    ex = Exchange(run.ep, nbytes, run.s.memops)
    cases = _cases(run, ex)
    rows = _diag_rows(run, ex) if run.s.graphs and not _memops_only(run) else []
    P = run.ep.size
    for name, graph, fn in cases:
        fn = (lambda f=fn: f(0)) if graph else fn
        alone = run.timed(fn)
        rows.append(dict(backend=name, graph=graph, layout="bytes", tokens_per_rank=0, bytes_per_rank=ex.nbytes,
                         dispatch_us=alone, combine_us=alone, p2p_limit_GBps=run.p2p, alone_us=alone,
                         algbw_GBps=ex.nbytes * (P - 1) / P / alone / 1e3,
                         **beside_gemm(run, fn, carveout=None if graph else 0)))
    ex.check_fault()
    return rows


def bytes_rows(run: Run) -> list:
    rows = []
    for nbytes in run.s.sizes:
        rows += _size_rows(run, nbytes)
        torch.cuda.synchronize()      # the size's buffers are freed before the next size allocates
        run.save(rows)
    return rows
