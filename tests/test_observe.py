"""kvsimd.observe: the events a model reports (token positions per half, cross-attention
projections) counted by attached observers, against counts taken from the calls' own arguments;
observing changes neither the results nor the model."""
import threading

import numpy as np
import pytest

from kvsimd import KVSimdTypeError
from kvsimd.observe import EVENTS, Observer, notify, observe

from test_decoder_safety import random_encoder_decoder
from test_streaming import V, random_decoder


class Log(Observer):
    def __init__(self):
        self.events = []

    def positions(self, part, n):
        self.events.append(("positions", part, n))

    def cross_projections(self, n):
        self.events.append(("cross_projections", n))


def totals(log):
    out = {"decoder": 0, "encoder": 0, "cross": 0}
    for e in log.events:
        if e[0] == "positions":
            out[e[1]] += e[2]
        else:
            out["cross"] += e[1]
    return out


def test_base_observer_ignores_every_event():
    o = Observer()
    assert [getattr(o, e) for e in EVENTS]
    assert o.positions("decoder", 3) is None and o.cross_projections(2) is None


def test_decoder_reports_prefill_step_and_forward_positions(rng):
    m = random_decoder(n_layers=2)
    m.prefill_chunk = 4          # a prompt of 10 in chunks of 4, 4, 2: one event per chunk
    toks = list(rng.integers(0, V, 10))
    cache = m.new_cache(batch=2, capacity=16)
    with observe(m, Log()) as log:
        m.prefill(toks, cache=cache, seq=0)
        m.prefill(toks[:3], cache=cache, seq=1)
        for _ in range(2):
            m.step([1, 2], cache=cache)
        m.forward(toks[:7])
    assert log.events == [("positions", "decoder", n) for n in (4, 4, 2, 3, 2, 2, 7)]


def test_reevaluate_discard_reports_the_re_prefilled_tokens(rng):
    """capacity 12, 2 sinks, window 10: the step after a full prompt drops the 5 oldest window
    tokens and re-prefills the 7 kept ones, then runs its own token."""
    m = random_decoder()
    cache = m.new_cache(capacity=12, n_keep=2, policy="reevaluate")
    m.prefill(list(rng.integers(0, V, 12)), cache=cache)
    with observe(m, Log()) as log:
        m.step([3], cache=cache)
    assert totals(log)["decoder"] == (12 - 5) + 1


def test_encoder_decoder_reports_both_halves_and_cross_projections(rng):
    m = random_encoder_decoder()
    srcs = [list(rng.integers(3, V, 9)), list(rng.integers(3, V, 4))]
    with observe(m, Log()) as log:
        cross = m.cross_for(srcs)
        cache = m.new_cache(batch=2, capacity=8)
        for b in range(2):
            m.prefill([1], cache=cache, cross=cross, seq=b)
        m.step([5, 6], cache=cache, cross=cross)
    n_layers = len(m.layers)
    assert log.events == [("positions", "encoder", 9), ("cross_projections", n_layers),
                          ("positions", "encoder", 4), ("cross_projections", n_layers),
                          ("positions", "decoder", 1), ("positions", "decoder", 1), ("positions", "decoder", 2)]
    with observe(m, Log()) as log:
        m.forward(srcs[0], [1, 7, 8])                          # encoder once, decoder over 3 positions
        m.forward(srcs[0], [1, 7], enc_out=m.encode(srcs[1]))  # an encoder output passed in: encoded once
    assert totals(log) == {"encoder": 9 + 4, "decoder": 3 + 2, "cross": 0}


def test_several_observers_nest_and_detach(rng):
    a, b = random_decoder(), random_decoder(seed=1)
    toks = list(rng.integers(0, V, 5))
    outer, inner, other = Log(), Log(), Log()
    with observe(a, outer):
        a.forward(toks)
        with observe(a, inner), observe(b, other):
            a.forward(toks[:2])
            b.forward(toks[:3])
        a.forward(toks[:1])
    a.forward(toks)                              # nothing attached: nobody hears it
    assert [e[2] for e in outer.events] == [5, 2, 1]
    assert [e[2] for e in inner.events] == [2]
    assert [e[2] for e in other.events] == [3]


def test_an_exception_in_the_block_detaches_the_observer(rng):
    m = random_decoder()
    log = Log()
    with pytest.raises(RuntimeError):
        with observe(m, log):
            raise RuntimeError("boom")
    m.forward([1, 2])
    assert log.events == []


def test_an_observer_that_raises_leaves_the_cache_as_it_was(rng):
    class Boom(Observer):
        def positions(self, part, n):
            raise RuntimeError("observer failed")
    m = random_decoder()
    cache = m.new_cache(capacity=16)
    m.prefill(list(rng.integers(0, V, 6)), cache=cache)
    before = cache.length(0), np.array(cache.keys(0))
    with observe(m, Boom()):
        with pytest.raises(RuntimeError, match="observer failed"):
            m.step([4], cache=cache)
    assert cache.length(0) == before[0] and np.array_equal(np.array(cache.keys(0)), before[1])


def test_observing_changes_neither_results_nor_the_model(rng):
    """Same logits observed or not, and nothing is stored on the model (an assigned attribute
    would mark its weights for re-validation)."""
    m = random_decoder(n_layers=2)
    toks = list(rng.integers(0, V, 8))

    def run():
        cache = m.new_cache(capacity=16)
        out = [m.prefill(toks, cache=cache)]
        out += [m.step([t], cache=cache)[0] for t in (3, 4, 5)]
        return np.stack(out)
    plain = run()
    names = set(vars(m))
    with observe(m, Log()) as log:
        observed = run()
        assert set(vars(m)) == names
        assert not any(v is log or v is log.events for v in vars(m).values())
    assert np.array_equal(plain, observed)


def test_concurrent_observe_on_one_model(rng):
    """Threads attaching and detaching observers on one model: each hears exactly its own block."""
    m = random_decoder()
    toks = list(rng.integers(0, V, 4))
    logs = [Log() for _ in range(4)]
    go = threading.Barrier(len(logs))

    def work(log):
        go.wait()
        for _ in range(20):
            with observe(m, log):
                pass
    ts = [threading.Thread(target=work, args=(log,)) for log in logs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    m.forward(toks)
    assert all(log.events == [] for log in logs)
    with observe(m, logs[0]):
        m.forward(toks)
    assert logs[0].events == [("positions", "decoder", 4)]


def test_notify_without_observers_is_a_no_op():
    m = random_decoder()
    notify(m, "positions", "decoder", 3)       # nothing attached: no error, nothing recorded
    with observe(random_decoder(seed=1), Log()) as log:
        notify(m, "positions", "decoder", 3)   # another model observed: still nothing for this one
    assert log.events == []


@pytest.mark.parametrize("model, observer, message", [
    ("not a model", Log(), r"model must be a kvsimd\.Decoder or kvsimd\.EncoderDecoder, got str"),
    (None, Log(), r"model must be a kvsimd\.Decoder or kvsimd\.EncoderDecoder, got NoneType"),
    ("decoder", object(), r"observer must be a kvsimd\.observe\.Observer, got object"),
    ("decoder", Log, r"observer must be a kvsimd\.observe\.Observer, got type"),
])
def test_bad_arguments_are_kvsimd_type_errors(model, observer, message):
    if model == "decoder":
        model = random_decoder()
    with pytest.raises(KVSimdTypeError, match=message):
        with observe(model, observer):
            pass
