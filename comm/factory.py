"""The comm backends by name, and the process-wide caches that let every MoE layer of a stack share one.

    resolve_backend("auto", ep)  -> "symm" on CUDA ranks of one host, "torch" elsewhere
    make_backend(name, ep, ...)  -> a new backend (``TorchBackend``, ``SymmBackend``, ``DeepEPBackend``)
    shared_backend(name, ep, ...) -> the backend every layer with the same group and options shares
    shared_streams(device)       -> the side streams every layer of the process shares

Knobs arrive as arguments (``symm`` options, ``hidden_size`` for DeepEP's buffer, ``sends``): this module knows
nothing of the model side's configs.
"""

from __future__ import annotations

import socket
import weakref

import torch

from . import streams as st
from .group import EPGroup
from .options import SymmOptions
from .torch_backend import TorchBackend

__all__ = ["BACKENDS", "make_backend", "resolve_backend", "shared_backend", "shared_streams"]

BACKENDS = ("auto", "torch", "symm", "deepep")

# (group, rank, backend name, options) -> the backend every layer of this process shares (see ``shared_backend``)
_SHARED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_ONE_HOST: dict = {}      # id(process group) -> whether its ranks share one host (asked once per group)
_STREAMS: dict = {}       # str(device) -> the side streams of every layer (``shared_streams``)


def _one_host(ep: EPGroup) -> bool:
    """Whether every rank of ``ep`` runs on this host (collective the first time for a group)."""
    if ep.size == 1:
        return True
    key = id(ep.pg)
    if key not in _ONE_HOST:
        _ONE_HOST[key] = len(set(ep.gather_objects(socket.gethostname()))) == 1
    return _ONE_HOST[key]


def resolve_backend(name: str, ep: EPGroup, sends: str = "wave") -> str:
    """A backend name as run: "auto" is "symm" on a CUDA group whose ranks share one host (no host sync,
    CUDA-graph capturable), "torch" elsewhere (CPU and gloo, ROCm, groups across hosts); with ``sends="once"``
    always "symm" (the backend that implements it; emulated over gloo off the GPU). Collective for "auto"
    the first time a group is seen (every rank of ``ep`` calls it together, as WaveMoE's constructor does)."""
    if name != "auto":
        return name
    if sends == "once" or (ep.device.type == "cuda" and torch.version.cuda is not None and _one_host(ep)):
        return "symm"
    return "torch"


def shared_streams(device) -> st.Streams:
    """One set of side streams per device for every layer of the process (layers run one after another)."""
    key = str(device)
    if key not in _STREAMS:
        _STREAMS[key] = st.Streams.for_device(device, num_extra=3)   # up to 4 expert streams (WaveConfig)
    return _STREAMS[key]


def make_backend(name: str, ep: EPGroup, comm_stream=None, *, symm: SymmOptions | None = None,
                 hidden_size: int | None = None, sends: str = "wave"):
    """A new comm backend by name (``auto``, ``torch``, ``symm``, ``deepep``) issuing its transfers on
    ``comm_stream``. ``symm``: the symm backend's options; ``hidden_size``: the row width DeepEP's buffer is sized
    for (needed by ``deepep``); ``sends``: the schedule's sends ("once" resolves "auto" to "symm")."""
    name = resolve_backend(name, ep, sends)
    if name == "torch":
        return TorchBackend(ep, comm_stream=comm_stream)
    if name == "symm":
        from .symm import SymmBackend
        return SymmBackend(ep, symm, comm_stream=comm_stream)
    if name == "deepep":
        if hidden_size is None:
            raise ValueError("make_backend('deepep', hidden_size=None): DeepEP's buffer is sized for the hidden size; "
                             "pass it")
        from .deepep import DeepEPBackend
        return DeepEPBackend(ep, hidden_size=hidden_size, comm_stream=comm_stream)
    raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")


def shared_backend(name: str, ep: EPGroup, *, symm: SymmOptions | None = None, hidden_size: int | None = None,
                   sends: str = "wave"):
    """The backend for (``ep``, ``name``, options) that every layer of this process shares: one set of symmetric
    buffers for a whole stack (layers run one after another, and the backend orders each call's writes behind the
    previous call's reads). It lives while some layer holds it. Arguments as ``make_backend``."""
    name = resolve_backend(name, ep, sends)
    symm = SymmOptions() if symm is None else symm
    key = (id(ep.pg) if ep.pg is not None else str(ep.device), ep.rank, name,
           symm if name == "symm" else None, hidden_size if name == "deepep" else None)
    backend = _SHARED.get(key)
    if backend is None:
        backend = make_backend(name, ep, shared_streams(ep.device).comm, symm=symm, hidden_size=hidden_size,
                               sends=sends)
        _SHARED[key] = backend
    return backend
