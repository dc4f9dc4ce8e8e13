"""``python -m moe_wave demo``: a stack of V4 decoder layers over the EP ranks, serial vs overlapped.

Legend: B batch (1), S tokens per rank, N hc streams, D hidden, L layers, W waves, P ranks.

Each rank builds the same random-weight stack (``moe_wave.tools.stack``; it keeps only its experts) and runs
its own S tokens through it in two modes, interleaved iteration by iteration:

  serial      attention branches on one stream, MoE dispatch -> experts -> combine one after another
  overlapped  attention branches on side streams (``--attn-overlap``), MoE wave pipeline (``--overlap``)

On a GPU with the symm backend (``--backend auto`` picks it on one host) every layer is captured in CUDA graphs,
one per mode at S tokens (``V4DecoderLayer.capture_graphs``; ``--no-graph`` or ``MOE_WAVE_GRAPH=0`` runs eagerly),
and each layer's parts are timed alone under graphs as well: its attention sublayer, its MoE block, and the MoE's
exchanges alone (comm-only) and expert compute alone (compute-only). The table's ``ideal`` is attention +
max(comm-only, compute-only): what a layer would take with every exchange hidden.

Checks: each layer under the overlapped schedule, fed the serial stack's input to that layer, must
agree with its serial output (layer by layer, so that a rounding difference is not amplified by
the discrete top-k choices of later layers); with the ``tiny`` preset the EP stack must also equal a
single-process stack (``EPGroup.single()``, every expert, same weights) on the rank's tokens. Bigger
presets have no single-process reference (one process cannot hold every expert).
"""

from __future__ import annotations

import statistics

import torch

from moe_wave.attention import CoreTuning, ScheduleConfig
from moe_wave.comm import EPGroup
from moe_wave.config import MoEConfig, WaveConfig
from moe_wave.env import EnvSettings
from moe_wave.fp8 import resolve_precision, set_fp8_gemm
from moe_wave.graphs import graph_capable
from moe_wave.profiling import set_nvtx
from moe_wave.timing import Clock, align, as_graph, iteration_us, l2_flush_buffer

from .flags import symm_options
from .stack import STACK_PRESETS, build_layer_stack, layer_kind, run_stack, stack_inputs

__all__ = ["run_demo_rank", "demo_configs", "print_demo", "resolve_defaults", "check_waves", "format_table", "TOL"]

# Relative error ||a - b|| / ||b|| allowed between two runs of the stack, per dtype.
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}

_DEFAULTS = {  # preset: (layers, tokens per rank, dtype, timed iterations, warm-up)
    "tiny": (3, 32, "float32", 3, 1),
    "v4-flash": (4, 2048, "bfloat16", 10, 3),
    "v4-pro": (2, 2048, "bfloat16", 10, 3),
}


def resolve_defaults(args, env: EnvSettings | None = None) -> None:
    """Fill the flags left at None: the preset-dependent ones (tiny on CPU, v4-flash on a GPU host), and the
    settings ``env`` (``moe_wave.env.read_env()``; None: no environment) may give, each under the rule flag >
    environment > default. Adds ``args.symm`` (SymmOptions), ``args.nvtx`` and ``args.fp8_gemm``. ValueError for a bad
    value."""
    env = env or EnvSettings()
    if args.preset is None:
        args.preset = "v4-flash" if torch.cuda.is_available() else "tiny"
    layers, tokens, dtype, iters, warmup = _DEFAULTS[args.preset]
    for name, value in (("layers", layers), ("tokens", tokens), ("dtype", dtype), ("iters", iters),
                        ("warmup", warmup)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.layers < 1:
        raise ValueError(f"--layers={args.layers}: must be >= 1")
    if args.tokens < 1:
        raise ValueError(f"--tokens={args.tokens}: the layer stack needs >= 1 token per rank (attention runs "
                         "on each rank's own sequence)")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters={args.iters}, --warmup={args.warmup}: need iters >= 1 and warmup >= 0")
    args.symm = symm_options(args, env, (args.backend,))
    args.overlap = env.pick("overlap", args.overlap, True)
    args.attn_overlap = env.pick("attn_overlap", args.attn_overlap, True)
    args.attn_kernels = env.pick("attn_kernels", args.attn_kernels, "auto")
    args.precision = resolve_precision(env.pick("precision", getattr(args, "precision", None), "auto"),
                                       "cuda" if torch.cuda.is_available() else "cpu")
    args.graph = env.pick("graph", getattr(args, "graph", None), None)      # None: where capture is possible
    if args.graph and not torch.cuda.is_available():
        raise ValueError("--graph (or MOE_WAVE_GRAPH=1): CUDA graphs need a GPU, and none is visible")
    args.autowave_cache = env.pick("autowave_cache", args.autowave_cache, None)
    args.kernel_cache = env.pick("kernel_cache", getattr(args, "kernel_cache", None), None)
    args.nvtx = env.pick("nvtx", None, False)
    args.fp8_gemm = env.pick("fp8_gemm", None, "auto")


def check_waves(args, world_size: int) -> None:
    """Complete ``--waves`` (default: 2, or 1 on one rank, where no row crosses and waves would only split the
    experts' work); ValueError when it asks for more waves than the local experts per rank under ``--partition
    experts`` (a wave is a block of local experts: the library would run fewer waves than asked)."""
    args.waves_default = getattr(args, "waves_default", False) or args.waves is None
    if args.waves_default:      # again for each world size (an args object may serve several runs)
        args.waves = 1 if world_size == 1 else 2
    if args.partition != "experts" or args.waves == "auto":
        return
    E = MoEConfig.preset(STACK_PRESETS[args.preset].moe).num_experts
    e = -(-E // world_size)     # build_layer_stack rounds E up to a multiple of the ranks
    if args.waves > e:
        raise ValueError(f"--waves={args.waves}: must be <= {e}, the local experts per rank (preset {args.preset}: "
                         f"{E} experts over {world_size} ranks), with --partition experts, where a wave is a "
                         "block of local experts; or use --partition tokens")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _outputs(layers, inputs, overlap) -> list[torch.Tensor]:
    outs = []
    run_stack(layers, *inputs, overlap=overlap, after_layer=lambda i, X: outs.append(X))
    return outs


@torch.no_grad()
def _layerwise(layers, inputs, serial_outs, overlap) -> list[torch.Tensor]:
    """Each layer on the serial stack's input to it: compares schedules layer by layer, so one
    rounding difference is not amplified by the discrete choices (CSA top-k, MoE top-k) of later layers."""
    X0, pos, ids = inputs
    ins = [X0] + serial_outs[:-1]
    return [layer(ins[i], positions=pos, input_ids=ids, overlap=overlap, moe_overlap=overlap)
            for i, layer in enumerate(layers)]


def _bytes_hooks(layers, counter: list):
    """Pre-hooks on every MoE: the bytes of the rows that leave this rank and of their results coming back
    (``WaveMoE.traffic``: FP8 rows as they travel, the routing slots included)."""
    def hook(moe, args, kwargs):
        counter[0] += moe.traffic(args[0], kwargs.get("input_ids"))["bytes"]

    return [layer.moe.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]


def _time_modes(layers, inputs, ep, iters: int, warmup: int) -> dict:
    """Median per-layer and whole-stack ms for serial (overlap=False) and overlapped (configured)."""
    clock = Clock(ep.device)
    spans = {False: [], None: []}
    for it in range(warmup + iters):
        for mode in (False, None):  # interleaved: both modes see the same machine state
            align(ep)
            marks = [clock.mark()]
            run_stack(layers, *inputs, overlap=mode, validate=False,
                      after_layer=lambda i, X: marks.append(clock.mark()))
            if it >= warmup:
                spans[mode].append(clock.spans_ms(marks))
    med = {}
    for mode, rows in spans.items():
        per_layer = [statistics.median(r[i] for r in rows) for i in range(len(layers))]
        med[mode] = per_layer + [statistics.median(sum(r) for r in rows)]
    return {"serial": med[False], "overlapped": med[None]}


MODES = ((False, False), (None, None))     # (attention overlap, MoE overlap): serial, overlapped as configured


@torch.no_grad()
def _capture(layers, inputs) -> None:
    """Every layer in CUDA graphs, both modes, at this run's S (collective)."""
    S = inputs[0].shape[1]
    for layer in layers:
        layer.capture_graphs([S], modes=MODES)


@torch.no_grad()
def _part_times(layers, inputs, ep, iters: int, warmup: int) -> list[dict]:
    """Per layer, under CUDA graphs, each timed alone (median, slowest rank): the attention sublayer on its
    input, the MoE block (overlapped schedule), its exchanges alone and its expert compute alone (``tools.bench``
    kinds). Inputs are the serial stack's, grabbed by hooks."""
    from .bench import comm_only, compute_only, pre_receive

    grabbed: dict = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: grabbed.__setitem__(("attn", i), (a[0].clone(), kw["positions"])), with_kwargs=True))
        hooks.append(layer.moe.register_forward_pre_hook(
            lambda m, a, kw, i=i: grabbed.__setitem__(("moe", i), (a[0].clone(), kw.get("input_ids"))),
            with_kwargs=True))
    graphs = [layer.graphs for layer in layers]
    for layer in layers:
        layer.graphs = None                        # the hooks must see the eager modules' calls
    try:
        run_stack(layers, *inputs, overlap=False, validate=False)
    finally:
        for h, layer, g in zip(hooks, layers, graphs):
            layer.graphs = g
        for h in hooks:
            h.remove()
    dev = ep.device
    flush = l2_flush_buffer(dev)
    out = []
    for i, layer in enumerate(layers):
        a_in, pos = grabbed[("attn", i)]
        m_in, ids = grabbed[("moe", i)]
        moe = layer.moe
        ids_TK, w_TK = moe.route(m_in, ids)
        received = pre_receive(moe, m_in, ids_TK, w_TK)
        fns = {"attn": lambda k: layer.attn(a_in, positions=pos, validate=False),
               "moe": lambda k: moe(m_in, input_ids=ids),
               "comm": lambda k: comm_only(moe, m_in, ids_TK, w_TK),
               "compute": lambda k: compute_only(moe, m_in, received)}
        row = {}
        for name, fn in fns.items():
            replay = as_graph(fn, dev)[0]
            row[name] = statistics.median(iteration_us(replay, iters, warmup, ep=ep, flush=flush)) / 1e3
        out.append(row)
    names = ("attn", "moe", "comm", "compute")
    worst = ep.max_over([r[n] for r in out for n in names])
    return [dict(zip(names, worst[4 * i:4 * i + 4])) for i in range(len(layers))]


def demo_configs(args, world_size: int) -> tuple[WaveConfig, ScheduleConfig]:
    """The MoE schedule and the attention schedule of the overlapped run, from resolved ``args`` on
    ``world_size`` ranks (``check_waves`` completes ``--waves``)."""
    check_waves(args, world_size)
    wave = WaveConfig(num_waves=args.waves, partition=args.partition, sends=args.sends, backend=args.backend,
                      overlap=args.overlap, symm=args.symm, autowave_cache=args.autowave_cache)
    core = CoreTuning(kernel_cache=getattr(args, "kernel_cache", None))
    return wave, ScheduleConfig(overlap=args.attn_overlap, kernels=args.attn_kernels, core=core)


def run_demo_rank(ep, args) -> dict:
    """One rank of the demo: build the stack, check it, time serial vs overlapped.

    Returns the aggregated result (same on every rank): per-layer rows and the stack summary.
    """
    set_nvtx(args.nvtx)   # a spawned rank is a fresh process
    set_fp8_gemm(args.fp8_gemm)
    dtype = getattr(torch, args.dtype)
    wave, schedule = demo_configs(args, ep.size)
    layers = build_layer_stack(args.preset, args.layers, ep=ep, wave=wave, schedule=schedule, device=ep.device,
                                 dtype=dtype, seed=args.seed, fp8=args.precision == "fp8")
    E = layers[0].moe.cfg.num_experts
    inputs = stack_inputs(layers, args.tokens, seed=args.seed + 1 + ep.rank)  # different tokens per rank

    moved = [0]
    hooks = _bytes_hooks(layers, moved)
    off = _outputs(layers, inputs, False)
    for h in hooks:
        h.remove()
    on = _layerwise(layers, inputs, off, None)
    ref = None
    if STACK_PRESETS[args.preset].single_reference:
        single = build_layer_stack(args.preset, args.layers, ep=EPGroup.single(ep.device),
                                     wave=WaveConfig(num_waves=args.waves, partition=args.partition,
                                                     sends=args.sends, autowave_cache=args.autowave_cache),
                                     schedule=schedule, device=ep.device, dtype=dtype, seed=args.seed, num_experts=E,
                                     fp8=args.precision == "fp8")
        ref = _outputs(single, inputs, None)
        del single
    why = graph_capable(layers[0].moe.backend, ep.device)
    if args.graph and why is not None:
        raise ValueError(f"--graph: {why}")
    graphed = args.graph if args.graph is not None else why is None
    replayed = parts = None
    if graphed:
        _capture(layers, inputs)
        replayed = _outputs(layers, inputs, False)           # each layer replayed on the serial stack's input
    times = _time_modes(layers, inputs, ep, args.iters, args.warmup)
    if graphed:
        parts = _part_times(layers, inputs, ep, args.iters, args.warmup)

    last = len(layers) - 1
    mine = {"rank": ep.rank, "bytes": moved[0], "times": times,
            "onoff": [(_max_err(a, b), _rel(a, b)) for a, b in zip(on, off)],
            "graph": None if replayed is None else [(_max_err(a, b), _rel(a, b)) for a, b in zip(replayed, off)],
            "single": None if ref is None else [(_max_err(a, b), _rel(a, b)) for a, b in zip(on, ref)]}
    rows = ep.gather_objects(mine)

    def worst(key, i):  # (max abs err, rel err) over ranks for layer i
        if rows[0][key] is None:
            return None
        return tuple(max(r[key][i][j] for r in rows) for j in range(2))

    def slowest(mode, i):
        return max(r["times"][mode][i] for r in rows)

    per_layer = [{"layer": i, "kind": layer_kind(layers[i]), "serial_ms": slowest("serial", i),
                  "overlapped_ms": slowest("overlapped", i), "onoff": worst("onoff", i),
                  "single": worst("single", i), "graph": worst("graph", i),
                  "parts": None if parts is None else parts[i]} for i in range(len(layers))]
    stack = {"serial_ms": slowest("serial", len(layers)), "overlapped_ms": slowest("overlapped", len(layers)),
             "onoff": worst("onoff", last), "single": worst("single", last), "graph": worst("graph", last)}
    return {"ranks": ep.size, "experts": E, "backend_pg": ep.backend, "device": str(ep.device), "graphed": graphed,
            "backend": layers[0].moe.backend.name, "symm_bytes": _symm_bytes(layers),
            "tokens": args.tokens, "bytes": sum(r["bytes"] for r in rows), "layers": per_layer, "stack": stack,
            "waves": args.waves, "waves_default": args.waves_default}


# ----------------------------------------------------------------------------- printing

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain aligned table (no dependencies)."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def without_columns(headers: list[str], rows: list[list], drop) -> tuple[list[str], list[list]]:
    """``headers`` and ``rows`` less the columns named in ``drop``."""
    keep = [i for i, h in enumerate(headers) if h not in drop]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]


# On CPU the ranks share a few cores and streams are no-ops: times are noise, and no ratio of them is shown
CPU_NOTE = "on CPU the timings are not meaningful (the ranks share the cores; no streams): speedups left out"


def _err(e) -> str:
    return "n/a" if e is None else f"{e[0]:.1e}"


def _ok(row, tol) -> bool:
    return all(e is None or e[1] <= tol for e in (row["onoff"], row["single"], row.get("graph")))


def _symm_bytes(layers) -> int:
    """Symmetric-memory bytes per rank held by the stack's backends (one shared set: see ``WaveMoE``)."""
    backends = {id(layer.moe.backend): layer.moe.backend for layer in layers}
    return sum(getattr(b, "memory_bytes", lambda: 0)() for b in backends.values())


def _precision_text(args) -> str:
    if args.precision != "fp8":
        return "bf16 (the model dtype)" if args.dtype == "bfloat16" else f"{args.dtype} (the model dtype)"
    from moe_wave.fp8_experts import fp8_gemm_grouped_library

    lib = fp8_gemm_grouped_library("cuda" if torch.cuda.is_available() else "cpu")
    return ("fp8 (V4's own: FP8 attention projections and FP8 experts, "
            + ("DeepGEMM's grouped FP8 GEMMs)" if lib == "deepgemm" else "per-expert FP8 products)"))


def print_demo(res: dict, args) -> bool:
    """Print the summary and the per-layer overlap table; True when every check is within tolerance."""
    tol = max(TOL[args.dtype], TOL["bfloat16"]) if args.precision == "fp8" else TOL[args.dtype]
    st, layers = res["stack"], res["layers"]
    has_ref = st["single"] is not None
    attn_on, moe_on = args.attn_overlap, args.overlap   # resolved by resolve_defaults
    one = "; one wave, the default on one rank: no row crosses" if res["waves_default"] and res["ranks"] == 1 else ""
    print(f"moe-wave demo: preset {args.preset}, {len(layers)} layers, {res['experts']} experts, "
          f"{res['backend_pg']} on {res['device']}, waves {res['waves']} ({args.partition}, sends {args.sends}{one}), "
          f"backend {args.backend}, "
          f"overlapped run: attention overlap {'on' if attn_on else 'off'}, MoE overlap {'on' if moe_on else 'off'}; "
          f"{args.dtype}, precision {_precision_text(args)}, seed {args.seed}")
    ok = all(_ok(r, tol) for r in layers)
    summary = st["single"] if has_ref else st["onoff"]
    print(format_table(["ranks", "tokens/rank", "bytes moved", "time/iter", "max err", "check"],
                       [[res["ranks"], res["tokens"], _fmt_bytes(res["bytes"]), f"{st['overlapped_ms']:.2f} ms",
                         _err(summary), "ok" if ok else f"FAIL (rel tol {tol:.0e})"]]))
    print("bytes moved: MoE rows crossing ranks (dispatch + combine, all layers, one forward); time/iter: the "
          "overlapped stack; max err: " + ("EP stack vs the single-process stack (all experts, same weights)"
                                          if has_ref else "overlapped vs serial (no single-process reference "
                                          f"for {args.preset}: one process cannot hold every expert)"))
    graphed = res.get("graphed")
    print(f"comm backend {res.get('backend')}; layers {'replayed from CUDA graphs' if graphed else 'run eagerly'}"
          + (f"; symmetric buffers {_fmt_bytes(res['symm_bytes'])} per rank, one set shared by all "
             f"{len(layers)} layers (a 43-layer stack of the same shapes shares the same set)"
             if res.get("symm_bytes") else ""))
    print()

    def part_cols(r):
        p = r.get("parts")
        if p is None:
            return ["n/a"] * 5
        parts, ideal = p["attn"] + p["moe"], p["attn"] + max(p["comm"], p["compute"])
        return [f"{p['attn']:.2f}", f"{p['moe']:.2f}", f"{ideal:.2f}", f"{r['overlapped_ms'] / ideal:.2f}",
                f"{r['overlapped_ms'] / parts:.2f}"]

    rows = [[r["layer"], r["kind"], res["tokens"], f"{r['serial_ms']:.2f}", f"{r['overlapped_ms']:.2f}",
             f"{r['serial_ms'] / max(r['overlapped_ms'], 1e-9):.2f}x"] + part_cols(r)
            + [_err(r["onoff"]), _err(r.get("graph")), _err(r["single"]), "ok" if _ok(r, tol) else "FAIL"]
            for r in layers]
    sums = {k: sum(r["parts"][k] for r in layers) for k in ("attn", "moe")} if graphed and layers[0].get("parts") else None
    ideal_sum = sum(r["parts"]["attn"] + max(r["parts"]["comm"], r["parts"]["compute"]) for r in layers) if sums else None
    rows.append(["stack", f"{len(layers)} layers", res["tokens"], f"{st['serial_ms']:.2f}",
                 f"{st['overlapped_ms']:.2f}", f"{st['serial_ms'] / max(st['overlapped_ms'], 1e-9):.2f}x"]
                + ([f"{sums['attn']:.2f}", f"{sums['moe']:.2f}", f"{ideal_sum:.2f}",
                    f"{st['overlapped_ms'] / ideal_sum:.2f}", f"{st['overlapped_ms'] / (sums['attn'] + sums['moe']):.2f}"]
                   if sums else ["n/a"] * 5)
                + [_err(st["onoff"]), _err(st.get("graph")), _err(st["single"]), "ok" if ok else "FAIL"])
    headers = ["layer", "type", "tokens/rank", "serial ms", "overlapped ms", "speedup", "attn ms", "moe ms",
               "ideal ms", "ovl/ideal", "ovl/parts", "on vs off", "graph vs eager", "vs single", "check"]
    if res["device"] == "cpu":
        headers, rows = without_columns(headers, rows, ("speedup", "attn ms", "moe ms", "ideal ms", "ovl/ideal",
                                                        "ovl/parts"))
    print(format_table(headers, rows))
    print(f"serial: attention branches on one stream + MoE serial schedule; overlapped: attention side streams + "
          f"wave pipeline. attn ms / moe ms: the layer's attention sublayer and its MoE block, each timed alone"
          f" under CUDA graphs; ideal: attn + max(MoE exchanges alone, MoE compute alone); ovl/parts: overlapped"
          f" / (attn + moe), below 1 when overlap makes the layer cheaper than its parts. on vs off: each layer's"
          f" overlapped output vs its serial output on the same input; graph vs eager: the replayed serial layer vs"
          f" the eager one. Median of {args.iters} after {args.warmup} warm-up, slowest rank"
          + (f"; {CPU_NOTE}." if res["device"] == "cpu"
             else "." + ("" if graphed else " Parts are timed under CUDA graphs only (GPU, symm backend).")))
    return ok
