"""DeepSeek-V4's sparse attention core (spec 3.5): MQA of every query over the rows its parts pick, with sinks.

- ``call``: one call as a frozen record (``CoreCall``: operands, the steps around the core, checked once) and
  ``CoreTuning``, what remains tunable (``ScheduleConfig.core``).
- ``dispatch``: ``sparse_attention``, an ordered table of implementations (``IMPLS``), each answering
  ``supports(call)`` with the rule a call fails.
- ``cuda_impl`` (Hopper prefill, CUDA C++ in ``csrc/``, built by ``cuda_build`` with an on-disk cache),
  ``triton_impl`` / ``triton_kernels`` (portable, decode), ``reference`` (torch).
"""

from .call import CoreCall, CoreTuning, Steps, check_steps
from .dispatch import IMPLS, core_flops, core_impl, q_norm_inside, sparse_attention, sparse_attention_fused
from .reference import gather_rows
from .triton_impl import FALLBACKS, CoreConfig, default_config

__all__ = ["sparse_attention", "sparse_attention_fused", "core_impl", "q_norm_inside", "core_flops", "gather_rows",
           "CoreCall", "CoreTuning", "Steps", "check_steps", "CoreConfig", "default_config", "FALLBACKS", "IMPLS"]
