"""Kernels over NumPy arrays, on the active ISA path.

All functions take C-contiguous, aligned arrays, never copy their inputs, release the GIL
while the kernel runs, and raise :class:`kvsimd.KVSimdValueError` / :class:`kvsimd.KVSimdTypeError`
naming the problem for bad input.

Accuracy (tested on every path against :mod:`kvsimd.reference`, float64):

* ``attend``: ``|out - ref| <= 1e-5 * sum_j p_j |v_j|`` per element for float32 K/V, and 1e-4
  for float16 K/V (reference: float64 math on the fp16 values).  fp32 accumulation, online
  softmax, one pass over K and V.
* ``apply_rope`` / ``shift_keys``: angles are computed in double precision from the integer
  position or delta (exact up to 2**53).  float32: ``<= 1e-5 * |pair|`` per component.
  float16 on the scalar and avx2 paths: rotated in fp32 and rounded to fp16 once,
  ``<= 2**-11 * |out| + 2**-20 * |pair|``.  float16 on the avx512fp16 path: one VFMULCPH per
  complex pair, whose two roundings per component give ``3 * 2**-11 * |pair|``, plus
  ``sqrt(2)/2 * 2**-11 * |pair|`` for the (cos, sin) multiplier rounded to fp16 -- in all
  ``<= 4 * 2**-11 * |pair| + 2**-24`` per call.
* Rounding errors of successive calls add up: a token rotated k times carries up to k times
  the per-call bound.  A cache design must bound how many rotations any cached token sees.
* ``to_float16`` / ``to_float32``: bit-identical to NumPy's casts, NaN payloads included.
"""
from kvsimd._kvsimd import apply_rope, attend, shift_keys, to_float16, to_float32

__all__ = ["attend", "apply_rope", "shift_keys", "to_float16", "to_float32"]
