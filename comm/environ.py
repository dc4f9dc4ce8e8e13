"""The process environment of moe-wave: the one module of the library that reads or sets ``os.environ``.

Every variable the library, the CLI and the tools consult or set is declared in ``TABLE`` below, with the modules
that use it and what it means; a name ending in ``*`` declares a family by prefix (``MOE_WAVE_*``). The accessors
take declared names only: any other name is a ValueError naming the variable and the rule (declare it in
comm/environ.py's table).

- ``get(name, default=None)``, ``present(name)``: read one variable.
- ``view()``: a read-only Mapping over the process environment, restricted to the declared variables, for the
  functions that take ``env: Mapping`` (``detect_launcher``, ``moe_wave.env.read_env``). It is live: every
  lookup reads ``os.environ`` at that moment (``monkeypatch.setenv`` after import is seen).
- ``assign(name, value)``, ``set_default(name, value)``, ``update(mapping)``: write (values are str).

``moe_wave.env`` parses the ``MOE_WAVE_*`` family and documents each of its variables (its own table); this module
only declares the family. The module is standard library only: comm and the model side both import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["Variable", "TABLE", "declared", "entry", "get", "present", "view", "assign", "set_default", "update"]


class Variable(NamedTuple):
    """One row of ``TABLE``: ``users`` the modules that read or set it (named below ``moe_wave.``), ``meaning``."""

    users: tuple[str, ...]
    meaning: str


_BOOT, _TRITON, _ENV, _CLI = ("comm.bootstrap",), ("comm.triton_gate",), ("env",), ("cli",)
_SWEEP, _REPORT = ("tools.sweep",), ("tools.sweep_report",)

# name (or prefix*) -> who uses it, what it means. Launchers set the first groups; bootstrap reads them.
TABLE: Mapping[str, Variable] = MappingProxyType({
    # torchrun / plain env:// (detect_launcher: torchrun first)
    "TORCHELASTIC_RUN_ID": Variable(_BOOT, "set by torchrun's agent: a torchrun launch, the agent's store"),
    "RANK": Variable(_BOOT, "torchrun / env://: this process's rank"),
    "WORLD_SIZE": Variable(_BOOT, "torchrun / env://: the number of ranks"),
    "LOCAL_RANK": Variable(_BOOT, "torchrun: the rank on this host (unset: RANK)"),
    "LOCAL_WORLD_SIZE": Variable(_BOOT, "torchrun: the ranks on this host (unset: WORLD_SIZE)"),
    "MASTER_ADDR": Variable(_BOOT, "the rendezvous host (env://, srun, mpirun across hosts); read, and set to "
                                   "127.0.0.1 in self-spawned ranks"),
    "MASTER_PORT": Variable(_BOOT, "the rendezvous port (mpirun: unset, rank 0 picks a free one)"),
    # Open MPI (mpirun)
    "OMPI_COMM_WORLD_RANK": Variable(_BOOT, "Open MPI: this process's rank (marks an Open MPI launch)"),
    "OMPI_COMM_WORLD_SIZE": Variable(_BOOT, "Open MPI: the number of ranks"),
    "OMPI_COMM_WORLD_LOCAL_RANK": Variable(_BOOT, "Open MPI: the rank on this host"),
    "OMPI_COMM_WORLD_LOCAL_SIZE": Variable(_BOOT, "Open MPI: the ranks on this host"),
    # MPICH (Hydra)
    "PMI_RANK": Variable(_BOOT, "MPICH: this process's rank (marks an MPICH launch)"),
    "PMI_SIZE": Variable(_BOOT, "MPICH: the number of ranks"),
    "MPI_LOCALRANKID": Variable(_BOOT, "MPICH: the rank on this host"),
    "MPI_LOCALNRANKS": Variable(_BOOT, "MPICH: the ranks on this host"),
    # SLURM (srun)
    "SLURM_PROCID": Variable(_BOOT, "SLURM: this process's rank"),
    "SLURM_STEP_ID": Variable(_BOOT, "SLURM: set inside srun (a bare sbatch script is no launch)"),
    "SLURM_NTASKS": Variable(_BOOT, "SLURM: the number of ranks"),
    "SLURM_LOCALID": Variable(_BOOT, "SLURM: the rank on this host"),
    "SLURM_STEP_TASKS_PER_NODE": Variable(_BOOT, "SLURM: the ranks on this host in this step (\"4(x2)\")"),
    "SLURM_NTASKS_PER_NODE": Variable(_BOOT, "SLURM: the ranks on this host, without SLURM_STEP_TASKS_PER_NODE"),
    # set by bootstrap (the multicast-off ones in every process that imports moe_wave.comm: MULTICAST_OFF)
    "GLOO_SOCKET_IFNAME": Variable(_BOOT, "gloo's interface: set to lo when every rank is on this host (a value "
                                          "already set is kept, except in self-spawned ranks)"),
    "OMP_NUM_THREADS": Variable(_BOOT + _REPORT, "unset: self-spawned ranks share the cores (torch threads = "
                                                 "cores / ranks); recorded in sweep result files"),
    "NCCL_NVLS_ENABLE": Variable(_BOOT + _REPORT, "set to 0: NCCL's NVLink multicast off; recorded in result files"),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": Variable(_BOOT + _REPORT, "set to 1: torch symmetric memory's multicast "
                                                                  "off; recorded in result files"),
    "NVSHMEM_DISABLE_NVLS": Variable(_BOOT + _REPORT, "set to 1: NVSHMEM's NVLink multicast off; recorded in result "
                                                      "files"),
    "CUDA_VISIBLE_DEVICES": Variable(_BOOT + _REPORT, "the GPUs this process sees: named when local ranks "
                                                      "outnumber them; recorded in result files"),
    "NCCL_ALGO": Variable(_REPORT, "NCCL's algorithm choice, recorded in result files as it was"),
    "NCCL_PROTO": Variable(_REPORT, "NCCL's protocol choice, recorded in result files as it was"),
    # Triton
    "TRITON_INTERPRET": Variable(_TRITON, "1: Triton runs kernels in its CPU interpreter (read where Triton has "
                                          "no triton.knobs)"),
    # the tools
    "OUT": Variable(_SWEEP, "the folder the GPU scripts hand every tool for its results (sweep: $OUT/sweep.csv)"),
    # moe-wave's own knobs: parsed by moe_wave.env (its table, moe_wave.env.VARIABLES), listed by ``info``
    "MOE_WAVE_*": Variable(_ENV + _CLI, "moe-wave's settings: see moe_wave.env"),
})
_NAMES = frozenset(k for k in TABLE if not k.endswith("*"))
_PREFIXES = tuple(k[:-1] for k in TABLE if k.endswith("*"))
_RULE = "declare it in comm/environ.py's table (TABLE: the name, the modules that use it, what it means)"


def entry(name: str) -> str:
    """The key of ``TABLE`` that declares ``name`` (itself, or its family's ``PREFIX*``); ValueError if none."""
    if not isinstance(name, str):
        raise ValueError(f"environment variable name {name!r}: must be a str")
    if name in _NAMES:
        return name
    for prefix in _PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return prefix + "*"
    raise ValueError(f"environment variable {name!r} is not declared: moe-wave reads and sets only the variables "
                     f"it declares; {_RULE}")


def declared(name) -> bool:
    """Whether ``name`` is a declared variable (by name or by family)."""
    try:
        entry(name)
    except ValueError:
        return False
    return True


def _value(name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: an environment variable's value must be a str")
    return value


def get(name: str, default=None):
    """The value of the declared variable ``name``, or ``default`` where it is unset."""
    entry(name)
    return os.environ.get(name, default)


def present(name: str) -> bool:
    """Whether the declared variable ``name`` is set (to anything, the empty string included)."""
    entry(name)
    return name in os.environ


class _View(Mapping):
    """The declared variables of the process environment, read at each lookup; no item can be set through it."""

    __slots__ = ()

    def __getitem__(self, name: str) -> str:
        entry(name)
        return os.environ[name]

    def __contains__(self, name) -> bool:
        return present(name)

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in os.environ if declared(k)])   # a list: the environment may change meanwhile

    def __len__(self) -> int:
        return sum(1 for k in os.environ if declared(k))

    def __repr__(self) -> str:
        return f"moe_wave.comm.environ.view({dict(self)!r})"


_VIEW = _View()


def view() -> Mapping[str, str]:
    """The read-only, live Mapping of the declared variables (see the module docstring)."""
    return _VIEW


def assign(name: str, value: str) -> None:
    """Set the declared variable ``name`` to ``value`` (a str)."""
    entry(name)
    os.environ[name] = _value(name, value)


def set_default(name: str, value: str) -> str:
    """Set ``name`` to ``value`` unless it is set; returns the value it has then."""
    entry(name)
    return os.environ.setdefault(name, _value(name, value))


def update(values: Mapping[str, str]) -> None:
    """Set every variable of ``values``; all of them are checked before any is set."""
    checked = {}
    for name, value in dict(values).items():
        entry(name)
        checked[name] = _value(name, value)
    os.environ.update(checked)
