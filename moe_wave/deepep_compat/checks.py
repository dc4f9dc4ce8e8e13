"""``deep_ep.Buffer``'s argument checks: a ValueError naming the call, the field, its value and the rule, raised
on the host before anything runs (the device-side checks of values are ``guard``'s).

Legend: T local tokens, H hidden, K top-k, P ranks, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ["unsupported", "group_arg", "byte_size", "device_arg", "stream_args", "tensor", "route_args", "biases",
           "fp8_pair", "rows_arg", "config_arg", "num_experts_arg", "ROW_DTYPES", "FP8_DTYPES"]

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unsupported(call: str, alternative: str) -> NotImplementedError:
    return NotImplementedError(f"deep_ep.Buffer.{call}: not supported by moe-wave's deep_ep (one node, symmetric "
                               f"memory); {alternative}")


def group_arg(group, comm) -> None:
    """``Buffer(group=...)``: a torch.distributed ProcessGroup (an mpi4py ``comm`` is DeepEP's alternative)."""
    if group is None:
        if comm is not None:
            raise unsupported("__init__(comm=<mpi4py communicator>)", "pass group=<a torch.distributed "
                              "ProcessGroup over the same ranks> (e.g. dist.new_group(ranks))")
        raise ValueError("Buffer(group=None): pass the torch.distributed process group of the EP ranks")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"Buffer(group={group!r}): must be a torch.distributed ProcessGroup (e.g. "
                         f"dist.group.WORLD or dist.new_group(ranks)), got {type(group).__name__}")


def byte_size(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"Buffer({name}={v!r}): must be an int >= 0")


def device_arg(device, backend: str) -> torch.device | None:
    """``Buffer(device=...)`` as a torch.device: a CUDA device (where CUDA is available) or "cpu"; None: the
    default (the current CUDA device where there is one)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Buffer(device={device!r}): must be a CUDA device or 'cpu'") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"Buffer(device={device!r}): must be a CUDA device or 'cpu'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Buffer(device={device!r}): CUDA is not available in this process (torch "
                         f"{torch.__version__}, {'a CPU-only build' if torch.version.cuda is None else 'no GPU'}); "
                         f"pass device='cpu' with a gloo group")
    if dev.type == "cpu" and "nccl" in backend:
        raise ValueError(f"Buffer(device={device!r}): an NCCL group needs a CUDA device")
    return dev


def stream_args(what: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if previous_event is not None and not isinstance(previous_event, (EventOverlap, EventHandle)):
        raise ValueError(f"{what}: previous_event={previous_event!r} must be an EventOverlap (Buffer.capture()) or "
                         f"None")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(f"{what}: allocate_on_comm_stream=True needs previous_event and async_finish=True (DeepEP's "
                         f"rule)")


def tensor(what: str, name: str, t, dims: int, dtypes=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or (dtypes is not None and t.dtype not in dtypes):
        want = f"a {dims}-D tensor" + (f" of {', '.join(map(str, dtypes))}" if dtypes else "")
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: {name} is {got}: must be {want}")
    return t


def config_arg(what: str, config) -> None:
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"{what}: config={config!r} must be a deep_ep.Config or None")


def route_args(what, P, T, per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment, worst) -> tuple:
    """A dispatch's routing arguments (not a cached one): shapes, dtypes and ranges."""
    missing = [n for n, v in (("num_tokens_per_rank", per_rank), ("is_token_in_rank", in_rank),
                              ("num_tokens_per_expert", per_expert)) if v is None]
    if missing:
        raise ValueError(f"{what}: {', '.join(missing)} missing: pass get_dispatch_layout's outputs, or a handle")
    tensor(what, "num_tokens_per_rank", per_rank, 1, (torch.int32, torch.int64))
    tensor(what, "is_token_in_rank", in_rank, 2, (torch.bool,))
    tensor(what, "num_tokens_per_expert", per_expert, 1, (torch.int32, torch.int64))
    if per_rank.numel() != P or tuple(in_rank.shape) != (T, P):
        raise ValueError(f"{what}: num_tokens_per_rank {tuple(per_rank.shape)} / is_token_in_rank "
                         f"{tuple(in_rank.shape)}: must be [{P}] / [{T}, {P}] (ranks, tokens of x)")
    if per_expert.numel() == 0 or per_expert.numel() % P:
        raise ValueError(f"{what}: num_tokens_per_expert has {per_expert.numel()} experts: must be a positive "
                         f"multiple of the {P} ranks")
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError(f"{what}: pass topk_idx and topk_weights together, or neither")
    if topk_idx is not None:
        tensor(what, "topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        tensor(what, "topk_weights", topk_weights, 2, (torch.float32,))
        if topk_idx.shape[0] != T or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"{what}: topk_idx {tuple(topk_idx.shape)} / topk_weights "
                             f"{tuple(topk_weights.shape)}: must both be [{T}, K]")
    for name, v, lo in (("expert_alignment", alignment, 1), ("num_worst_tokens", worst, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{what}: {name}={v!r} must be an int >= {lo}")
    return per_rank, in_rank, per_expert, topk_idx, topk_weights, alignment, worst


def biases(what: str, bias, shape) -> tuple:
    if bias is None:
        return ()
    items = bias if isinstance(bias, tuple) else (bias,)
    if len(items) > 2:
        raise ValueError(f"{what}: bias holds {len(items)} tensors: DeepEP takes 0, 1 or 2")
    for i, b in enumerate(items):
        tensor(what, f"bias[{i}]", b, 2, ROW_DTYPES)
        if tuple(b.shape) != tuple(shape):
            raise ValueError(f"{what}: bias[{i}] is {tuple(b.shape)}: must be [{shape[0]}, {shape[1]}] "
                             f"(tokens, hidden)")
    return tuple(items)


def rows_arg(what: str, x) -> int:
    """A dispatch's ``x`` (a [T, H] tensor or an (fp8 [T, H], scales) pair): its tokens T."""
    if isinstance(x, torch.Tensor):
        tensor(what, "x", x, 2, ROW_DTYPES)
        return x.shape[0]
    fp8_pair(what, x)
    return x[0].shape[0]


def fp8_pair(what: str, x) -> None:
    if not isinstance(x, tuple) or len(x) != 2:
        raise ValueError(f"{what}: x must be a [T, H] tensor or an (fp8 [T, H], scales) tuple, got {type(x).__name__}")
    x8, sc = x
    tensor(what, "x[0]", x8, 2, FP8_DTYPES)
    if not isinstance(sc, torch.Tensor) or sc.dtype not in (torch.float32, torch.int32) or sc.dim() not in (1, 2) \
            or sc.shape[0] != x8.shape[0]:
        raise ValueError(f"{what}: x[1] (scales) is {getattr(sc, 'shape', type(sc))} {getattr(sc, 'dtype', '')}: must "
                         f"be float32 or int32, [{x8.shape[0]}] or [{x8.shape[0]}, S]")


def num_experts_arg(what: str, num_experts, P: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0 or num_experts % P:
        raise ValueError(f"{what}: num_experts={num_experts!r} must be a positive multiple of the {P} ranks")


def rank_errors(per_rank: list, mine: Exception | None) -> None:
    """After the construction's gather of each rank's argument error (its message, or None, in rank order): raise
    on every rank when any rank's arguments were bad, naming the first such rank and its error. This rank's own
    error is re-raised as it was (its type), with the rank (alone: unchanged); the others raise a ValueError quoting
    it."""
    bad = [(r, m) for r, m in enumerate(per_rank) if m]
    if not bad:
        return
    if len(per_rank) == 1:
        raise mine
    r, msg = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    text = f"rank {r}: {msg}{more}; every rank stops building its Buffer"
    if mine is not None and str(mine) == msg:
        raise type(mine)(text) from None
    raise ValueError(text)


def same_settings(per_rank: list) -> None:
    """Raise the same ValueError on every rank when the ranks' Buffer settings (a dict of field -> value each, in
    rank order: ``CompatOptions``, ``SymmOptions`` but its timeouts, the resolved device type) differ: the calls'
    collectives are shaped by them (the direct dispatch's count gather is ``normal_channels`` wide), so ranks that
    differ would meet in collectives of different sizes or kinds. Names the first differing field."""
    for name, mine in per_rank[0].items():
        values = [s.get(name) for s in per_rank]
        if any(v != mine for v in values):
            each = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values))
            raise ValueError(f"Buffer({name}): {each}; every rank must construct its Buffer with the same "
                             f"settings (arguments or MOE_WAVE_* environment)")
