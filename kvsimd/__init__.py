"""kvsimd: SIMD kernels, KV caches and decoders for incremental transformer decoding on the CPU.

The ISA path (``scalar``, ``avx2``, ``avx512``, ``avx512fp16``) is chosen once at import from CPUID;
``KVSIMD_FORCE_ISA`` forces one.  See :func:`isa_info` and :func:`show_runtime`."""
import os as _os

# A decode step is ~200 short OpenMP regions (matrix products, attention) a few microseconds
# apart, sometimes with BLAS calls (float32 weights) that run their own threads between them.
# Threads that sleep after each region pay a wake-up per region (SmolLM2 Q4_1, 2 threads on 2
# cores: 48 tok/s passive vs 276 spinning briefly; 1 thread: 180); threads that spin long starve
# BLAS (float32 weights: 3.1 tok/s spinning without limit, 21 at 30000 spins, 43 at 1000, 50
# passive).  So spin briefly, then sleep -- unless the user chose a policy or a spin count.
# Read by libgomp when the extension loads, so set before importing it.
# One libgomp serves the process: torch, loaded first, has already read the environment (and
# inside torch the brief spin costs torch's own threads: see kvsimd.integrations.transformers).
_SPIN_SET = (not _os.environ.get("OMP_WAIT_POLICY") and not _os.environ.get("GOMP_SPINCOUNT")
             and "torch" not in __import__("sys").modules)
if _SPIN_SET:   # (the bench gives its peers' processes libgomp's own default back)
    _os.environ["GOMP_SPINCOUNT"] = "1000"

try:
    from kvsimd._kvsimd import __version__, active_isa, attend_isa, cpu_features, isa_info, show_runtime
    from kvsimd._kvsimd import QMatrix, weight_types
except ImportError as _e:   # a bad KVSIMD_FORCE_ISA: under `python -m kvsimd`, one line and exit 2
    from kvsimd.__main__ import exit_if_cli
    exit_if_cli(_e)
    raise
from kvsimd import errors, ops
from kvsimd.cache import CrossAttentionCache, KVCache
from kvsimd.nn import Decoder, EncoderDecoder
from kvsimd.nn import ModelConfig
from kvsimd.threads import get_num_threads, set_num_threads
from kvsimd.threads import _init_from_env as _threads_from_env
from kvsimd.errors import (KVSimdBusyError, KVSimdCapacityError, KVSimdError, KVSimdISAError, KVSimdMemoryError,
                           KVSimdPositionError, KVSimdTypeError, KVSimdValueError)

__all__ = [
    "__version__", "KVCache", "CrossAttentionCache", "Decoder", "EncoderDecoder", "ModelConfig", "set_num_threads", "get_num_threads", "active_isa", "attend_isa", "cpu_features", "isa_info", "show_runtime", "ops", "errors",
    "QMatrix", "weight_types",
    "KVSimdError", "KVSimdValueError", "KVSimdTypeError", "KVSimdISAError", "KVSimdCapacityError",
    "KVSimdPositionError", "KVSimdBusyError", "KVSimdMemoryError",
]

try:
    _threads_from_env()
except KVSimdError as _e:   # a bad KVSIMD_NUM_THREADS: under `python -m kvsimd`, one line and exit 2
    from kvsimd.__main__ import exit_if_cli
    exit_if_cli(_e)
    raise
