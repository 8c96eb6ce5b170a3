# cython: language_level=3
"""kvsimd's compiled core: runtime ISA dispatch and the kernels over NumPy arrays.

One extension module holds all C code, so there is exactly one dispatch table per process."""
cimport numpy as cnp
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libc.math cimport sqrtf, expf, erff, tanhf
from cpython.pythread cimport PyThread_get_thread_ident

from kvsimd._capi cimport *

cnp.import_array()

__version__ = KV_VERSION.decode()

include "_runtime.pxi"      # dispatch, isa_info, show_runtime, thread count
include "_validate.pxi"     # the boundary checks, RopeSpec, the attention params, status codes
include "_weights.pxi"      # QMatrix: weights as a file stores them (quantized, 16-bit), their product
include "_ops.pxi"          # kvsimd.ops: kernels over NumPy arrays
include "_probes.pxi"       # benchmark probes
include "_hooks.pxi"        # testing hooks (ISA switch, the emulator harness)
include "_cache.pxi"        # _KVStore, KVCache (ring, policies, transactions), CrossAttentionCache
include "_plan.pxi"         # the attention plan of a forward pass
include "_layer.pxi"        # Linear, Norm, Block, Layers: the one transformer layer
