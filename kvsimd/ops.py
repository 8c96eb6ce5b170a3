"""Kernels over NumPy arrays, on the active ISA path.

All functions take C-contiguous, aligned arrays, never copy their inputs (but for the query
that ``attend(..., hadamard=True)`` turns in a copy), release the GIL while the kernel runs,
and raise :class:`kvsimd.KVSimdValueError` / :class:`kvsimd.KVSimdTypeError` naming the
argument and the value for bad input.  An output (``out``, or the array rotated in
place) must not share memory with any input of the same call; positions, deltas and ALiBi
positions are integers within +-2**53; ``scale`` is finite and within float32's range;
``softcap`` is None or 0 (off) or a number in 2**-126..2**126.

Accuracy (tested on every path against :mod:`kvsimd.reference`, float64; the functions of
:mod:`kvsimd.bounds` state the same bounds, ``u = 2**-11``, per output component):

* ``attend``: ``|out - ref| <= 1e-5 * sum_j p_j |v_j|`` per element for float32 K/V, and 1e-4
  for float16 K/V (reference: float64 math on the fp16 values); int8 and int4 K/V with block scales
  as float32 (reference: float64 math on the values ``q * scale`` the rows stand for).  fp32 accumulation, online
  softmax, one pass over K and V.  With ``hadamard=True`` (rows stored turned by H), against float64
  math on H of those values: that bound over the stored rows with the query H q, plus the float32
  turns of q and of the output, summed over each block of 32
  (:func:`kvsimd.bounds.attend_bound` with ``hadamard=True``).  With ALiBi, plus the fp32 rounding of each bias
  ``b_j = slope * (query_position - key_position)`` in its score, ``e_j = 2 * 2**-24 * |b_j|``,
  through the softmax: ``sum_j p_j e_j |v_j| + (sum_k p_k e_k) * sum_j p_j |v_j|``.  With
  ``softcap``, the same term with ``e_j = 16 * 2**-24 * |c_j|`` (``c_j = cap * tanh(s_j / cap)``,
  the capped score), the cap's own rounding (:func:`kvsimd.bounds.softcap_score_error`).
* ``apply_rope`` / ``shift_keys``: angles are computed in double precision from the integer
  position or delta (exact up to 2**53).  float32: ``<= 1e-5 * |pair|`` per component.
  float16 on the scalar, avx2 and avx512 paths: rotated in fp32 and rounded to fp16 once,
  ``<= u * |out| + 2**-20 * |pair| + 2**-25``.  float16 on the avx512fp16 path: the
  (cos, sin) multiplier split into fp16 hi + lo, ``x * lo`` by VFMULCPH then ``x * hi`` plus
  that by VFMADDCPH, which rounds each component twice:
  ``<= u * (|pair| + |out|) + 2**-18 * |pair| + 2**-23`` per call.  With an attention factor
  above 1 (``apply_rope(attn_factor=...)``), ``|pair|`` counts that many times.
* Rounding errors of successive calls add up: a token rotated k times carries up to k times
  the per-call bound.  A cache design must bound how many rotations any cached token sees.
* ``to_float16`` / ``to_float32``: bit-identical to NumPy's casts, NaN payloads included.
* ``quantize_kv``: bit-identical to the rule in NumPy float32 (``kvsimd.reference.quantize_kv``);
  ``|x - q * scale| <= scale / 2``.  ``shift_keys`` on int8 or int4 keys: the float32 rotation bound plus
  half a step of the new scale per call (``kvsimd.bounds.quantized_shift_bound``).
"""
from kvsimd._kvsimd import apply_rope, attend, quantize_kv, shift_keys, to_float16, to_float32

__all__ = ["attend", "apply_rope", "quantize_kv", "shift_keys", "to_float16", "to_float32"]
