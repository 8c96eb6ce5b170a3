"""Test helpers."""
import contextlib

from kvsimd import _kvsimd


@contextlib.contextmanager
def use_isa(name):
    """Run the block on ISA path ``name``, with the same checks as ``KVSIMD_FORCE_ISA``
    (unknown, not compiled or not supported by this CPU -> :class:`kvsimd.KVSimdISAError`).
    Process-global: meant for tests, not for concurrent use."""
    prev = _kvsimd.isa_info()
    _kvsimd._set_isa(name)
    try:
        yield name
    finally:
        _kvsimd._restore_isa(prev["active"], prev["forced"])
