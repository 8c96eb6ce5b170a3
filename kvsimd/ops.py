"""Kernels over NumPy arrays, on the active ISA path.

All functions take C-contiguous, aligned arrays, never copy their inputs, release the GIL
while the kernel runs, and raise :class:`kvsimd.KVSimdValueError` / :class:`kvsimd.KVSimdTypeError`
naming the problem for bad input."""
from kvsimd._kvsimd import apply_rope, attend, shift_keys, to_float16, to_float32

__all__ = ["attend", "apply_rope", "shift_keys", "to_float16", "to_float32"]
