"""Exceptions raised by kvsimd.

Every kvsimd error derives from :class:`KVSimdError` and also from the builtin a caller
would catch anyway (``ValueError``, ``TypeError``...), so ``except ValueError`` works.
"""


class KVSimdError(Exception):
    """Base class of every kvsimd error."""


class KVSimdValueError(KVSimdError, ValueError):
    """An argument has the right type but a bad value: shape, range, contiguity, alignment."""


class KVSimdTypeError(KVSimdError, TypeError):
    """An argument has the wrong type or dtype."""


class KVSimdISAError(KVSimdError, ValueError):
    """An ISA path that is unknown, not compiled into this build, or not runnable on this CPU."""


class KVSimdCapacityError(KVSimdValueError):
    """A cache has no room for what was appended; the cache is left unchanged."""


class KVSimdPositionError(KVSimdValueError):
    """A token position is out of the range an operation accepts."""


class KVSimdMemoryError(KVSimdError, MemoryError):
    """A cache (or other buffer kvsimd allocates) larger than this machine can hold."""


class KVSimdBusyError(KVSimdError, RuntimeError):
    """An object that allows one user at a time (a KVCache during a call or a decode step)
    is in use by another thread.  Share a model between threads, never a cache."""
