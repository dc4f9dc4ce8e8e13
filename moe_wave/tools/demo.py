"""``python -m moe_wave demo``: a stack of V4 decoder layers over the EP ranks, serial vs overlapped.

Legend: B batch (1), S tokens per rank, N hc streams, D hidden, L layers, W waves, P ranks.

Each rank builds the same random-weight stack (``moe_wave.tools.stack``; it keeps only its experts) and runs
its own S tokens through it in two modes, interleaved iteration by iteration:

  serial      attention branches on one stream, MoE dispatch -> experts -> combine one after another
  overlapped  attention branches on side streams (``--attn-overlap``), MoE wave pipeline (``--overlap``)

Checks: each layer under the overlapped schedule, fed the serial stack's input to that layer, must
agree with its serial output (layer by layer, so that a rounding difference is not amplified by
the discrete top-k choices of later layers); with the ``tiny`` preset the EP stack must also equal a
single-process stack (``EPGroup.single()``, every expert, same weights) on the rank's tokens. Bigger
presets have no single-process reference (one process cannot hold every expert).
"""

from __future__ import annotations

import statistics

import torch

from moe_wave.attention import ScheduleConfig
from moe_wave.comm import EPGroup
from moe_wave.comm.layout import compute_layout
from moe_wave.config import MoEConfig, WaveConfig
from moe_wave.env import EnvSettings
from moe_wave.profiling import set_nvtx
from moe_wave.timing import Clock, align

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
    environment > default. Adds ``args.symm`` (SymmOptions) and ``args.nvtx``. ValueError for a bad value."""
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
    args.autowave_cache = env.pick("autowave_cache", args.autowave_cache, None)
    args.nvtx = env.pick("nvtx", None, False)


def check_waves(args, world_size: int) -> None:
    """ValueError when ``--waves`` asks for more waves than the local experts per rank under ``--partition
    experts`` (a wave is a block of local experts: the library would run fewer waves than asked)."""
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
    """Pre-hooks on every MoE: rows that leave this rank, once per (token, peer, wave), there and back."""
    def hook(moe, args, kwargs):
        x_TD = args[0]
        sent_WP = compute_layout(*moe.route(x_TD, kwargs.get("input_ids")), moe.plan).send_counts_WP
        remote = int(sent_WP.sum() - sent_WP[:, moe.ep.rank].sum())
        counter[0] += 2 * remote * x_TD.shape[-1] * x_TD.element_size()

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


def demo_configs(args) -> tuple[WaveConfig, ScheduleConfig]:
    """The MoE schedule and the attention schedule of the overlapped run, from resolved ``args``."""
    wave = WaveConfig(num_waves=args.waves, partition=args.partition, backend=args.backend, overlap=args.overlap,
                      symm=args.symm, autowave_cache=args.autowave_cache)
    return wave, ScheduleConfig(overlap=args.attn_overlap, kernels=args.attn_kernels)


def run_demo_rank(ep, args) -> dict:
    """One rank of the demo: build the stack, check it, time serial vs overlapped.

    Returns the aggregated result (same on every rank): per-layer rows and the stack summary.
    """
    set_nvtx(args.nvtx)   # a spawned rank is a fresh process
    dtype = getattr(torch, args.dtype)
    wave, schedule = demo_configs(args)
    layers = build_layer_stack(args.preset, args.layers, ep=ep, wave=wave, schedule=schedule, device=ep.device,
                                 dtype=dtype, seed=args.seed)
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
                                                     autowave_cache=args.autowave_cache),
                                     schedule=schedule, device=ep.device, dtype=dtype, seed=args.seed, num_experts=E)
        ref = _outputs(single, inputs, None)
        del single
    times = _time_modes(layers, inputs, ep, args.iters, args.warmup)

    last = len(layers) - 1
    mine = {"rank": ep.rank, "bytes": moved[0], "times": times,
            "onoff": [(_max_err(a, b), _rel(a, b)) for a, b in zip(on, off)],
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
                  "single": worst("single", i)} for i in range(len(layers))]
    stack = {"serial_ms": slowest("serial", len(layers)), "overlapped_ms": slowest("overlapped", len(layers)),
             "onoff": worst("onoff", last), "single": worst("single", last)}
    return {"ranks": ep.size, "experts": E, "backend_pg": ep.backend, "device": str(ep.device),
            "tokens": args.tokens, "bytes": sum(r["bytes"] for r in rows), "layers": per_layer, "stack": stack}


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


def _err(e) -> str:
    return "n/a" if e is None else f"{e[0]:.1e}"


def _ok(row, tol) -> bool:
    return all(e is None or e[1] <= tol for e in (row["onoff"], row["single"]))


def print_demo(res: dict, args) -> bool:
    """Print the summary and the per-layer overlap table; True when every check is within tolerance."""
    tol = TOL[args.dtype]
    st, layers = res["stack"], res["layers"]
    has_ref = st["single"] is not None
    attn_on, moe_on = args.attn_overlap, args.overlap   # resolved by resolve_defaults
    print(f"moe-wave demo: preset {args.preset}, {len(layers)} layers, {res['experts']} experts, "
          f"{res['backend_pg']} on {res['device']}, waves {args.waves} ({args.partition}), backend {args.backend}, "
          f"overlapped run: attention overlap {'on' if attn_on else 'off'}, MoE overlap {'on' if moe_on else 'off'}; "
          f"{args.dtype}, seed {args.seed}")
    ok = all(_ok(r, tol) for r in layers)
    summary = st["single"] if has_ref else st["onoff"]
    print(format_table(["ranks", "tokens/rank", "bytes moved", "time/iter", "max err", "check"],
                       [[res["ranks"], res["tokens"], _fmt_bytes(res["bytes"]), f"{st['overlapped_ms']:.2f} ms",
                         _err(summary), "ok" if ok else f"FAIL (rel tol {tol:.0e})"]]))
    print("bytes moved: MoE rows crossing ranks (dispatch + combine, all layers, one forward); time/iter: the "
          "overlapped stack; max err: " + ("EP stack vs the single-process stack (all experts, same weights)"
                                          if has_ref else "overlapped vs serial (no single-process reference "
                                          f"for {args.preset}: one process cannot hold every expert)"))
    print()
    rows = [[r["layer"], r["kind"], res["tokens"], f"{r['serial_ms']:.2f}", f"{r['overlapped_ms']:.2f}",
             f"{r['serial_ms'] / max(r['overlapped_ms'], 1e-9):.2f}x", _err(r["onoff"]), _err(r["single"]),
             "ok" if _ok(r, tol) else "FAIL"] for r in layers]
    rows.append(["stack", f"{len(layers)} layers", res["tokens"], f"{st['serial_ms']:.2f}",
                 f"{st['overlapped_ms']:.2f}", f"{st['serial_ms'] / max(st['overlapped_ms'], 1e-9):.2f}x",
                 _err(st["onoff"]), _err(st["single"]), "ok" if ok else "FAIL"])
    print(format_table(["layer", "type", "tokens/rank", "serial ms", "overlapped ms", "speedup", "on vs off",
                        "vs single", "check"], rows))
    print(f"serial: attention branches on one stream + MoE serial schedule; overlapped: attention side streams + "
          f"wave pipeline; on vs off: each layer's overlapped output vs its serial output on the same input. "
          f"Median of {args.iters} after {args.warmup} warm-up, slowest rank"
          + ("; on CPU the attention's stream ops are no-ops (same code both ways)." if res["device"] == "cpu"
             else "."))
    return ok
