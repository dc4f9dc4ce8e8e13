"""WaveMoE: the DeepSeek-V4 MoE block on the wave pipeline, with the shared expert in the bubbles.

Legend: T local tokens, D hidden, I intermediate, E experts, e local experts, K top-k, P ranks,
W waves, R received rows, C shared down_proj chunks.

    x_TD --router--> topk_ids_TK, topk_w_TK --layout--> counts; prepare (count exchange, 1 host sync)
    alt stream:  shared gate_up + act + down[:C-tail]   ...   (wait last experts) down[C-tail:]
    waves:       dispatch / experts / combine (moe_wave.pipeline)
    join:        y_TD = routed (fp32 accumulation) + shared
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from moe_wave.comm import EPGroup
from moe_wave.comm import streams as st
from moe_wave.comm.factory import shared_backend, shared_streams
from moe_wave.comm.header import CallHeader, HeaderMismatch
from moe_wave.comm.layout import WavePlan, compute_layout, rows_to_peers

from . import autowave
from .config import MoEConfig, WaveConfig, require_hf
from .experts import RoutedExperts, SharedExpert, V4Router, expert_rows
from .fp8_experts import FP8RoutedExperts, FP8SharedExpert
from .fp8_rows import pack_rows, packed_width, unpack_rows
from .graphs import BucketGraphs, graph_capable
from .pipeline import run_waves
from .profiling import annotate

__all__ = ["WaveMoE"]

_BUILT: dict = {}         # id(process group) -> WaveMoE schedules made over it (the ranks make them together)


def _number(ep: EPGroup) -> int:
    """The next module number of ``ep``'s group: every rank builds (and reschedules) its modules together, in the
    same order (``_check_agree`` is collective), so the numbers agree between ranks."""
    key = id(ep.pg) if ep.pg is not None else None
    _BUILT[key] = _BUILT.get(key, 0) + 1
    return _BUILT[key]


def _backend_for(ep: EPGroup, cfg: MoEConfig, wave: WaveConfig):
    """The shared comm backend of ``wave``'s choice (``moe_wave.comm.factory.shared_backend``)."""
    return shared_backend(wave.backend, ep, symm=wave.symm, hidden_size=cfg.hidden_size, sends=wave.sends)


def _check_agree(ep: EPGroup, cfg: MoEConfig, wave: WaveConfig, dtype: torch.dtype) -> None:
    """Every setting that must agree between ranks, in one gather (the same ValueError on every rank)."""
    ep.check_same("WaveMoE settings", {
        "MoE shape (hidden, intermediate, num_experts, top_k)":
            (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k),
        "WaveConfig (num_waves, experts_per_wave, partition, sends, backend, overlap, shared_placement)":
            (wave.num_waves, wave.experts_per_wave, wave.partition, wave.sends, wave.backend, wave.overlap,
             wave.shared_placement),
        "WaveConfig.expert_streams": wave.expert_streams, "WaveConfig.fp8_rows": wave.fp8_rows,
        "SymmOptions": wave.symm, "dtype": str(dtype)})


class _SharedSchedule:
    """Places the shared expert's pieces on the alt stream (see WaveConfig.shared_placement)."""

    def __init__(self, shared: SharedExpert, wave: WaveConfig, streams: st.Streams, overlap: bool):
        self.shared, self.streams = shared, streams
        self.placement = wave.shared_placement if overlap and streams.enabled else "serial"
        self.C = wave.shared_chunks
        self.tail = wave.shared_tail_chunks if self.placement == "bubbles" else 0
        self.x = self.h = self.out = self.quantised = None

    def start(self, x_TD: torch.Tensor, quantised: tuple | None = None) -> None:
        """Queue the head of shared(x) on the alt stream; ``out`` will hold shared(x) once
        ``before_last_wait`` has run (serial: computed there, on the current stream). ``quantised``: x in the FP8
        activation format (q, s) where the dispatch's packed rows already hold it (the FP8 shared expert reads it
        instead of quantising x again: the same bits)."""
        self.x, self.quantised = x_TD, quantised
        if self.placement == "serial":
            self.out = torch.empty_like(x_TD)
            return
        alt = self.streams.alt
        st.wait_stream(alt, st.current_stream(x_TD.device))
        if quantised is not None:       # views of the dispatch's packed rows, read on the alt stream
            st.keep_alive(quantised[0], alt)
        with st.on(alt), annotate("shared.up+down_head"):
            self.h = self._up()
            self.out = torch.empty_like(x_TD)
            for c in range(self.C - self.tail):
                self.shared.down_chunk(self.h, c, self.C, self.out)
        st.keep_alive(x_TD, alt)

    def before_last_combine(self) -> None:
        """Release the tail: it runs on the alt stream while the last combine is on the wire."""
        if self.tail == 0:
            return
        alt = self.streams.alt
        st.wait_stream(alt, st.current_stream(self.x.device))
        with st.on(alt), annotate("shared.down_tail"):
            for c in range(self.C - self.tail, self.C):
                self.shared.down_chunk(self.h, c, self.C, self.out)

    def before_last_wait(self) -> None:
        """shared(x) is ready on the current stream: computed there (serial), or waited for (alt stream)."""
        cur = st.current_stream(self.x.device)
        if self.placement == "serial":
            with annotate("shared.serial"):   # the same row chunks as on the alt stream: bitwise equal
                h = self._up()
                for c in range(self.C):
                    self.shared.down_chunk(h, c, self.C, self.out)
        else:
            st.wait_stream(cur, self.streams.alt)
            st.keep_alive(self.out, cur)
        self.x = self.h = self.quantised = None

    def _up(self):
        if self.quantised is None:
            return self.shared.up(self.x)
        return self.shared.up(self.x, quantised=self.quantised)


class WaveMoE(nn.Module):
    """DeepSeek-V4 MoE block over an expert-parallel group, wave-pipelined.

    Args:
        cfg: shapes and math (``MoEConfig``).
        ep: the expert-parallel group (default: single process). Rank r keeps experts
            [r*E/P, (r+1)*E/P).
        wave: the schedule (``WaveConfig``).
        device, dtype: of the parameters; ``device`` defaults to ``ep.device``.

    Forward: ``y = moe(x, input_ids=ids)``; x [T, D] (or [B, S, D]) local tokens in the parameter
    dtype; ids [T] token ids (hash layers). Returns y with x's shape and dtype. Every rank of the
    group must call forward together (with any T, zero included). Inference only: forward runs
    under ``torch.no_grad()`` (no backward through the all-to-all).
    """

    def __init__(self, cfg: MoEConfig, *, ep: EPGroup | None = None, wave: WaveConfig | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.ep = ep = ep or EPGroup.single(device)
        wave = wave or WaveConfig()
        device = torch.device(device) if device is not None else ep.device
        if cfg.num_experts % ep.size:
            raise ValueError(f"MoEConfig.num_experts={cfg.num_experts}: must be divisible by the EP size {ep.size}")
        _check_agree(ep, cfg, wave, dtype or torch.get_default_dtype())
        self.num_local = cfg.num_experts // ep.size
        self.expert_offset = ep.rank * self.num_local
        self.gate = V4Router(cfg, device=device, dtype=dtype)
        self.experts = RoutedExperts(cfg, self.num_local, wave.grouped_mm, device=device, dtype=dtype)
        self.shared = SharedExpert(cfg, device=device, dtype=dtype) if cfg.num_shared_experts else None
        self.streams = shared_streams(device)
        self._schedule(wave, _backend_for(ep, cfg, wave))

    def _schedule(self, wave: WaveConfig, backend) -> None:
        """Take ``wave`` as the schedule, over ``backend``."""
        self.wave, self.backend = wave, backend
        self.number, self.calls = _number(self.ep), 0      # the call header's module and call fields
        self.plan = WavePlan.make(num_ranks=self.ep.size, num_local_experts=self.num_local,
                                  num_waves=wave.waves_for(self.num_local), partition=wave.partition,
                                  sends=wave.sends)
        # num_waves="auto": the plan above is a placeholder until the first forward resolves it
        self._auto_pending = wave.num_waves == "auto" and wave.experts_per_wave is None
        self.auto_source: str | None = None
        self.auto_model: autowave.WaveTimeModel | None = None
        self.graphs: BucketGraphs | None = None     # capture_graphs() fills it

    def rescheduled(self, wave: WaveConfig) -> "WaveMoE":
        """A WaveMoE that shares this one's parameters (no copy) and runs under ``wave``: a benchmark changes
        the schedule without re-creating the expert weights (25 GB per rank for V4-Pro). Every rank must call
        it together (the settings are checked across ranks, as at construction). The comm backend is shared
        while ``wave`` keeps its backend and symm options; an ``auto`` wave count is resolved again."""
        if wave.grouped_mm != self.wave.grouped_mm:
            raise ValueError(f"WaveConfig.grouped_mm={wave.grouped_mm!r}: rescheduled() keeps the experts' "
                             f"{self.wave.grouped_mm!r}; build a new WaveMoE to change it")
        _check_agree(self.ep, self.cfg, wave, self.gate.weight.dtype)
        m = copy.copy(self)
        m._schedule(wave, _backend_for(self.ep, self.cfg, wave))
        return m

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf(cls, hf_block, hf_config, *, ep: EPGroup | None = None, wave: WaveConfig | None = None,
                layer_idx: int | None = None, device=None, dtype=None, **cfg_overrides) -> "WaveMoE":
        """Build from a transformers ``DeepseekV4SparseMoeBlock`` and copy its weights (this rank's
        experts only). Needs transformers: pip install 'moe-wave[hf]'."""
        require_hf("WaveMoE.from_hf")
        if layer_idx is None:
            is_hash = hasattr(hf_block.gate, "tid2eid")
            cfg = MoEConfig.from_hf(hf_config, None, hash_routing=is_hash, **cfg_overrides)
        else:
            cfg = MoEConfig.from_hf(hf_config, layer_idx, **cfg_overrides)
        p = hf_block.gate.weight
        m = cls(cfg, ep=ep, wave=wave, device=device, dtype=dtype or p.dtype)
        m.load_hf(hf_block)
        return m

    @property
    def fp8(self) -> bool:
        """Whether the experts are in the FP8 format (``quantize_fp8``)."""
        return isinstance(self.experts, FP8RoutedExperts)

    @torch.no_grad()
    def quantize_fp8(self) -> "WaveMoE":
        """Put the routed experts and the shared expert in DeepSeek-V4's FP8 format (e4m3 weights, 128 x 128
        power-of-two block scales; ``moe_wave.fp8_experts``), quantised from the current weights, which are
        dropped; the router stays as it is. Hidden and intermediate sizes must be multiples of 128. On a Hopper
        GPU with ``deep_gemm`` the expert stage runs DeepGEMM's grouped FP8 GEMMs; elsewhere the same math per
        expert (``fp8_experts.fp8_gemm_grouped_library`` says which). Loading after this (``load_hf``,
        ``load_full``, ``experts.load_fp4``) quantises what it loads. Returns self."""
        if self.fp8:
            return self
        self.experts = FP8RoutedExperts.from_dense(self.cfg, self.experts.gate_up.detach(), self.experts.down.detach())
        if self.shared is not None:
            sh = self.shared
            self.shared = FP8SharedExpert(self.cfg, sh.gate_proj, sh.up_proj, sh.down_proj)
        return self

    def _load_experts(self, gate_up: torch.Tensor, down: torch.Tensor, shared: tuple | None) -> None:
        if self.fp8:
            self.experts.load_dense(gate_up, down)
            if shared is not None:
                self.shared = FP8SharedExpert(self.cfg, *(w.to(self.gate.weight.device) for w in shared))
            return
        self.experts.gate_up.copy_(gate_up)
        self.experts.down.copy_(down)
        if shared is not None:
            for p, w in zip((self.shared.gate_proj, self.shared.up_proj, self.shared.down_proj), shared):
                p.copy_(w)

    @torch.no_grad()
    def load_hf(self, hf_block) -> None:
        lo, hi = self.expert_offset, self.expert_offset + self.num_local
        self.gate.weight.copy_(hf_block.gate.weight)
        if self.cfg.hash_routing:
            self.gate.tid2eid.copy_(hf_block.gate.tid2eid.long())
        else:
            self.gate.e_score_correction_bias.copy_(hf_block.gate.e_score_correction_bias.float())
        s = hf_block.shared_experts if self.shared is not None else None
        self._load_experts(hf_block.experts.gate_up_proj[lo:hi], hf_block.experts.down_proj[lo:hi],
                           None if s is None else (s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight))

    @torch.no_grad()
    def load_full(self, full: dict) -> None:
        """Load from a dict of full (all-expert) tensors: ``gate``, ``bias``, ``tid2eid`` (hash),
        ``gate_up`` [E, 2I, D], ``down`` [E, D, I], ``shared_gate``, ``shared_up``, ``shared_down``."""
        lo, hi = self.expert_offset, self.expert_offset + self.num_local
        self.gate.weight.copy_(full["gate"])
        if self.cfg.hash_routing:
            self.gate.tid2eid.copy_(full["tid2eid"])
        else:
            self.gate.e_score_correction_bias.copy_(full["bias"])
        self._load_experts(full["gate_up"][lo:hi], full["down"][lo:hi],
                           None if self.shared is None else
                           (full["shared_gate"], full["shared_up"], full["shared_down"]))

    # ------------------------------------------------------------------ forward
    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        D = self.cfg.hidden_size
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            raise ValueError(f"x: shape {tuple(getattr(x, 'shape', ()))}: must be [T, D] or [B, S, D]")
        if x.shape[-1] != D:
            raise ValueError(f"x.shape[-1]={x.shape[-1]}: must equal hidden_size={D}")
        if x.dtype != self.gate.weight.dtype:
            raise ValueError(f"x.dtype={x.dtype}: must equal the parameter dtype {self.gate.weight.dtype}")
        if x.device != self.gate.weight.device:
            raise ValueError(f"x.device={x.device}: must be the parameters' device {self.gate.weight.device}")
        return x.reshape(-1, D)

    def route(self, x_TD: torch.Tensor, input_ids: torch.Tensor | None = None):
        """(topk_ids [T, K] int64 global expert ids, topk_w [T, K] fp32)."""
        with annotate("router"):
            return self.gate(x_TD, input_ids)

    @property
    def packs_rows(self) -> bool:
        """Whether rows travel as FP8 (``WaveConfig.fp8_rows``, FP8 experts, bf16 activations)."""
        return self.wave.fp8_rows and self.fp8 and self.gate.weight.dtype == torch.bfloat16

    def wire(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """(the rows the dispatches send for x_TD, the combine's row width where it differs from theirs): x_TD and
        None, or where rows travel as FP8 (``packs_rows``) ``fp8_rows.pack_rows(x_TD)`` (quantised once for every
        wave and peer) and D."""
        if not self.packs_rows:
            return x_TD, None
        with annotate("pack_rows"):
            return pack_rows(x_TD), x_TD.shape[1]

    @staticmethod
    def _quantised(x_send: torch.Tensor, D: int) -> tuple:
        """(q [T, D], s [D/128, T]): ``act_quant``'s pair of x, viewed in the packed rows (``fp8_rows``)."""
        q, s = unpack_rows(x_send, D)
        return q, s.t()

    def routed_rows(self, got) -> torch.Tensor:
        """Expert compute for one wave's received rows (local; never communicates)."""
        return expert_rows(got, self.experts, packed=self.packs_rows)

    @torch.no_grad()
    def capture_graphs(self, buckets, overlaps=(True,)) -> "WaveMoE":
        """Capture ``forward`` in CUDA graphs, one per (token bucket, overlap); from then on a call with T tokens
        replays the smallest bucket >= T (padded; the pad is sent nowhere) and a T above the largest runs
        eagerly. Collective: every rank captures the same buckets together, before serving (``moe_wave.graphs``).
        ValueError where the backend or device cannot capture."""
        why = graph_capable(self.backend, self.gate.weight.device)
        if why is not None:
            raise ValueError(f"WaveMoE.capture_graphs: {why}")
        self.ep.check_same("WaveMoE.capture_graphs (buckets, overlaps)", (tuple(buckets), tuple(overlaps)))
        graphs = BucketGraphs(buckets, self.gate.weight.device)
        D, dev, dt = self.cfg.hidden_size, self.gate.weight.device, self.gate.weight.dtype
        for b in graphs.buckets:
            static = {"x": torch.zeros(b, D, device=dev, dtype=dt)}
            if self.cfg.hash_routing:
                static["input_ids"] = torch.zeros(b, dtype=torch.long, device=dev)
            for ov in overlaps:
                graphs.capture(b, bool(ov), dict(static), lambda n, **kw: self._forward_eager(
                    kw["x"], kw.get("input_ids"), overlap=bool(ov), num_valid=n))
        self.graphs = graphs
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None, *, overlap: bool | None = None,
                num_valid: torch.Tensor | None = None):
        """``num_valid``: see ``forward_routed`` (a caller that pads, e.g. a decoder layer's own graph); with it the
        call runs eagerly (or inside the caller's capture)."""
        self.calls += 1         # before any check: a call that raises on one rank only still counts there
        x_TD = self._check_input(x)
        overlap = self.wave.overlap if overlap is None else overlap
        g = self.graphs
        if g is not None and num_valid is None and not torch.cuda.is_current_stream_capturing():
            b = g.bucket_for(x_TD.shape[0])
            if b is not None and g.has(b, overlap):
                inputs = {"x": x_TD} if input_ids is None else {"x": x_TD, "input_ids": input_ids.reshape(-1)}
                return g.replay(b, overlap, inputs, x_TD.shape[0]).view(x.shape)
        return self._forward_eager(x_TD, input_ids, overlap=overlap, num_valid=num_valid).view(x.shape)

    def _forward_eager(self, x_TD, input_ids, *, overlap: bool, num_valid: torch.Tensor | None = None):
        ids_TK, w_TK = self.route(x_TD, input_ids)
        return self._forward_routed(x_TD, ids_TK, w_TK, overlap=overlap, num_valid=num_valid)

    @torch.no_grad()
    def forward_routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, *,
                       overlap: bool = True, num_valid: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE after routing: dispatch -> experts -> combine (+ shared); [T, D] in x's dtype. ``num_valid``
        (a 0-dim device tensor n): the tokens past n are padding, sent nowhere (their rows hold only the shared
        expert's output)."""
        self.calls += 1
        return self._forward_routed(x_TD, ids_TK, w_TK, overlap=overlap, num_valid=num_valid)

    @torch.no_grad()
    def traffic(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> dict:
        """What one forward of x moves between this rank and the others (counted from its layout; local, HOST
        SYNC: for tools and tests): ``rows`` (rows dispatched to other ranks over every wave; the combines return as
        many), ``row_bytes`` (a dispatched row on the wire: its values, bf16 or ``fp8_rows``' FP8 + scales, plus
        the K (expert id, weight) slots), ``back_bytes`` (a returned row), ``dispatch_bytes``, ``combine_bytes``
        and ``bytes``, their sum. With sends "once" the rows are W = 1's at every W."""
        x_TD = self._check_input(x)
        ids_TK, w_TK = self.route(x_TD, input_ids)
        plan = self.plan if not self._auto_pending else WavePlan.make(
            num_ranks=self.ep.size, num_local_experts=self.num_local, num_waves=1, partition=self.wave.partition)
        rows = rows_to_peers(compute_layout(ids_TK, w_TK, plan), self.ep.rank)
        D, K, elt = x_TD.shape[1], self.cfg.top_k, x_TD.element_size()
        row = (2 * packed_width(D) if self.packs_rows else D * elt) + 8 * K
        return {"rows": rows, "row_bytes": row, "back_bytes": D * elt, "dispatch_bytes": rows * row,
                "combine_bytes": rows * D * elt, "bytes": rows * (row + D * elt)}

    def header(self, x_TD: torch.Tensor, overlap: bool) -> CallHeader:
        """This call's header (``moe_wave.comm.header``), checked across ranks by the count exchange."""
        return CallHeader(kind="WaveMoE.forward", module=self.number, call=self.calls, overlap=bool(overlap),
                          hidden=x_TD.shape[-1], dtype=x_TD.dtype)

    def _forward_routed(self, x_TD, ids_TK, w_TK, *, overlap: bool, num_valid: torch.Tensor | None):
        if self._auto_pending:   # every rank together: measures once per shape (cached)
            choice = autowave.resolve(self, x_TD, ids_TK, w_TK)
            self.plan, self.auto_source, self.auto_model = choice.plan, choice.source, choice.model
            self._auto_pending = False
        shared = _SharedSchedule(self.shared, self.wave, self.streams, overlap) if self.shared is not None else None
        with annotate("layout"):
            layout = compute_layout(ids_TK, w_TK, self.plan, num_valid)
        x_send, width = self.wire(x_TD)
        if shared is not None:
            packed = width is not None and isinstance(self.shared, FP8SharedExpert)
            shared.start(x_TD, quantised=self._quantised(x_send, width) if packed else None)
        with annotate("prepare"):
            try:
                xplan = self.backend.prepare(layout, header=self.header(x_TD, overlap))
            except HeaderMismatch as e:     # every rank raises it: the same module agrees on its count again
                if all(h["module"] == self.number for h in e.headers):
                    self.calls = max(h["call"] for h in e.headers)
                raise
        acc_TD = torch.empty(x_TD.shape, dtype=torch.float32, device=x_TD.device)   # wave 0 writes every row
        # the last wave's combine sums its rows, adds shared(x) (fp32) and writes the result in x's dtype in
        # one pass: the same fp32 operations as accumulating, adding and casting one after another
        out_TD = torch.empty_like(x_TD)
        return run_waves(x_send, xplan, self.backend, self.routed_rows, acc_TD, overlap=overlap, hooks=shared,
                         fresh=True, add_TD=shared.out if shared is not None else None, dst_TD=out_TD,
                         local_view=True,    # routed_rows reads this rank's own rows where they are
                         expert_streams=self.streams.extra[:self.wave.expert_streams - 1], combine_width=width)
