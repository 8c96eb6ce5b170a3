"""kvsimd: SIMD kernels, KV caches and decoders for incremental transformer decoding on the CPU.

The ISA path (``scalar``, ``avx2``, ``avx512fp16``) is chosen once at import from CPUID;
``KVSIMD_FORCE_ISA`` forces one.  See :func:`isa_info` and :func:`show_runtime`."""
import os as _os

# Decoding alternates short OpenMP regions (attention) with BLAS calls that run their own
# threads: OpenMP threads spinning after each region would starve BLAS on a small machine
# (measured here: 2 threads, 3.8 tok/s spinning vs 25.6 passive).  Sleep instead, unless the
# user chose otherwise.  Read by libgomp when the extension loads, so set before importing it.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    from kvsimd._kvsimd import __version__, active_isa, cpu_features, isa_info, show_runtime
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
    "__version__", "KVCache", "CrossAttentionCache", "Decoder", "EncoderDecoder", "ModelConfig", "set_num_threads", "get_num_threads", "active_isa", "cpu_features", "isa_info", "show_runtime", "ops", "errors",
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
