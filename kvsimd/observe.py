"""Observers: what a model reports while it runs, for benchmarks and for your own accounting.

The model core calls :func:`notify` at a few points; :func:`observe` attaches an
:class:`Observer` to one model for the length of a ``with`` block (several may be attached,
to the same model or to others)::

    class Count(Observer):
        def __init__(self):
            self.decoder = 0

        def positions(self, part, n):
            if part == "decoder":
                self.decoder += n

    with observe(model, Count()) as c:
        model.prefill(ids, cache=cache)
    print(c.decoder)          # len(ids)

Events (methods of :class:`Observer`; the base class ignores them all):

* ``positions(part, n)``: ``n`` token positions ran through the layers of ``part``,
  ``"decoder"`` (a prefill chunk, a decode step of the whole batch, an uncached forward, the
  re-prefill of a ``reevaluate`` discard) or ``"encoder"`` (one source encoded);
* ``cross_projections(n)``: ``n`` (layer, sequence) cross-attention K/V projections were made
  (an encoder-decoder's ``cross_for``: one per decoder layer and source).
* ``drafts(proposed, accepted)``: a prompt-lookup pass of ``generate(..., lookup=n)`` verified
  ``proposed`` drafted tokens and kept the first ``accepted`` of them.

Nothing is stored on the model (assigning an attribute of a model marks its weights for
re-validation), and while nothing is attached anywhere :func:`notify` returns after one
lookup.  An observer runs inside the call that reports to it: an exception it raises is the
call's exception (a prefill or step then leaves the cache as it was).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from kvsimd.errors import KVSimdTypeError

__all__ = ["Observer", "observe", "notify", "EVENTS"]

EVENTS = ("positions", "cross_projections", "drafts")


class Observer:
    """Base class of observers: override the events you want; the others do nothing."""

    def positions(self, part: str, n: int) -> None:
        """``n`` token positions ran through the layers of ``part`` ("decoder" or "encoder")."""

    def cross_projections(self, n: int) -> None:
        """``n`` (layer, sequence) cross-attention K/V projections were made."""

    def drafts(self, proposed: int, accepted: int) -> None:
        """A prompt-lookup pass verified ``proposed`` drafted tokens and kept ``accepted``."""


# id(model) -> (model, observers): the model is held while anything observes it, so its id stays
# its own; the tuples are replaced, never changed, so notify reads them without the lock.
_attached: dict = {}
_lock = threading.Lock()


def notify(model, event: str, *args) -> None:
    """Report ``event(*args)`` of ``model`` to the observers attached to it (what the core calls)."""
    if _attached:                      # nothing attached anywhere: this lookup is the whole cost
        entry = _attached.get(id(model))
        if entry is not None:
            for obs in entry[1]:
                getattr(obs, event)(*args)


@contextmanager
def observe(model, observer: Observer):
    """Attach ``observer`` to ``model`` (a :class:`kvsimd.Decoder` or :class:`kvsimd.EncoderDecoder`)
    for the ``with`` block; yields the observer."""
    from kvsimd import Decoder, EncoderDecoder     # (the models import this module)
    if not isinstance(model, (Decoder, EncoderDecoder)):
        raise KVSimdTypeError("model must be a kvsimd.Decoder or kvsimd.EncoderDecoder, got %s"
                              % type(model).__name__)
    if not isinstance(observer, Observer):
        raise KVSimdTypeError("observer must be a kvsimd.observe.Observer, got %s" % type(observer).__name__)
    key = id(model)
    with _lock:
        _, current = _attached.get(key, (model, ()))
        _attached[key] = (model, current + (observer,))
    try:
        yield observer
    finally:
        with _lock:
            rest = list(_attached[key][1])
            del rest[next(i for i, o in enumerate(rest) if o is observer)]
            if rest:
                _attached[key] = (model, tuple(rest))
            else:
                del _attached[key]
