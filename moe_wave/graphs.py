"""CUDA graphs per token-count bucket: a module's forward replayed with changing inputs, routing and counts.

Legend: T tokens of a call, b the bucket (the captured token count, T <= b), D hidden.

A ``BucketGraphs`` holds, per (bucket, key), one captured call on static buffers: the inputs padded to b rows
and a device scalar ``n`` (the valid rows). A call copies its T rows into the static inputs, sets n, replays
and returns a copy of the first T output rows. Padding rows are never sent anywhere (``compute_layout``'s
``num_valid``) and never read by a valid row (attention is causal, the pad sits at the end), so what a valid
row gets does not depend on them.

Capture is collective: every rank of the EP group captures the same buckets and keys together
(``WaveMoE.capture_graphs`` / ``V4DecoderLayer.capture_graphs``), before serving; each capture runs the call
eagerly ``warmup`` times first (which allocates the backend's buffers and signals). After that a replay and an
eager call do the same exchanges, so ranks may pick different buckets (or fall back to eager for a T above the
largest bucket) call by call. Only sync-free backends capture (``symm``); ``torch`` reads counts on the host.

Switch: ``capture_graphs`` is what turns graphs on for a module; ``moe_wave.env`` reads ``MOE_WAVE_GRAPH``
(0 turns it off where a tool would capture by default) and the demo has ``--graph/--no-graph``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["BucketGraphs", "check_buckets", "graph_capable", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (128, 512, 2048, 4096)


def check_buckets(buckets) -> tuple[int, ...]:
    """Sorted distinct token counts >= 1, or a ValueError naming the value."""
    try:
        out = tuple(sorted({int(b) for b in buckets}))
    except (TypeError, ValueError):
        raise ValueError(f"buckets={buckets!r}: must be token counts (ints >= 1)") from None
    if not out or out[0] < 1 or any(isinstance(b, bool) for b in buckets):
        raise ValueError(f"buckets={buckets!r}: must be one or more token counts >= 1")
    return out


def graph_capable(backend, device: torch.device) -> str | None:
    """None where a module over ``backend`` can be captured on ``device``, else why not."""
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device (got {device})"
    name = getattr(backend, "name", None)
    if name not in (None, "symm"):
        return f"the {name!r} comm backend reads counts on the host, which a CUDA graph cannot (use backend='symm')"
    return None


class BucketGraphs:
    """Captured calls of one module, by (bucket, key); see the module docstring.

    Args:
        buckets: the token counts to capture (sorted, distinct).
        device: the CUDA device.
    """

    def __init__(self, buckets, device):
        self.buckets = check_buckets(buckets)
        self.device = torch.device(device)
        self._graphs: dict = {}      # (bucket, key) -> (graph, static inputs dict, n, output)

    def bucket_for(self, T: int) -> int | None:
        """The smallest bucket that holds T tokens, None above the largest."""
        return next((b for b in self.buckets if b >= T), None)

    def has(self, bucket: int, key) -> bool:
        return (bucket, key) in self._graphs

    def capture(self, bucket: int, key, static: dict, fn: Callable[..., torch.Tensor], warmup: int = 2) -> None:
        """Capture ``fn(n=n, **static)`` for ``bucket`` under ``key``: ``static`` holds the padded input buffers
        (b rows along their token dimension), ``n`` a 0-dim int64 tensor of the valid rows. Collective (the
        warm-up runs are eager calls)."""
        n = torch.full((), bucket, dtype=torch.int64, device=self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(n=n, **static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(n=n, **static)
        self._graphs[(bucket, key)] = (graph, static, n, out)

    def replay(self, bucket: int, key, inputs: dict, T: int, token_dim: int = 0) -> torch.Tensor:
        """Copy ``inputs`` (T rows along ``token_dim``) into the bucket's static buffers, replay, and return a
        copy of the first T output rows (along the same dimension)."""
        graph, static, n, out = self._graphs[(bucket, key)]
        for name, t in inputs.items():
            static[name].narrow(token_dim, 0, T).copy_(t)
        n.fill_(T)
        graph.replay()
        return out.narrow(token_dim, 0, T).clone()
