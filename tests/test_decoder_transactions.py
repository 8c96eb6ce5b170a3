"""A prefill or a decode step either completes or leaves the cache exactly as it was.

A KeyboardInterrupt is raised at the k-th of the calls a step makes (NumPy matrix products:
every projection of every layer; every KVCache method), for k = 1, 2, ... until the step completes
without reaching k.  After each interrupted step the cache must equal a copy taken before it:
lengths, ring heads, seen counts, token lists, and the positions, rotation counts, keys and values
(every layer) of every valid slot.  Then the step is run again and generation continued: the
logits must equal those of a run that was never interrupted, bit for bit.
"""
import numpy as np
import pytest

from kvsimd import KVCache

from test_streaming import V, random_decoder


class Interrupt:
    """Counts calls; raises KeyboardInterrupt at call number ``at`` (0: never)."""

    def __init__(self):
        self.n, self.at, self.fired = 0, 0, False

    def arm(self, at):
        self.n, self.at, self.fired = 0, at, False

    def disarm(self):
        """Stop interrupting; return whether the interrupt fired."""
        self.at = 0
        return self.fired

    def tick(self):
        self.n += 1
        if self.n == self.at:
            self.fired = True
            raise KeyboardInterrupt("injected at call %d" % self.n)


INTERRUPT = Interrupt()


class SpyCache(KVCache):
    """A KVCache whose every Python-level method is an interruption point."""

    def __init__(self, *args, **kwargs):
        pass


for _name in ("write", "commit", "_forget", "reset", "keys", "values", "shift_range", "length", "begin_step",
              "end_step", "begin_prefill", "end_prefill", "transaction"):
    def _wrap(name):
        def method(self, *args, **kwargs):
            INTERRUPT.tick()
            return getattr(KVCache, name)(self, *args, **kwargs)
        method.__name__ = name
        return method
    setattr(SpyCache, _name, _wrap(_name))


@pytest.fixture
def interruptible(monkeypatch):
    """Every np.matmul (the layers' projections) becomes an interruption point."""
    def counted(fn):
        def wrapper(*args, **kwargs):
            INTERRUPT.tick()
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(np, "matmul", counted(np.matmul))
    INTERRUPT.arm(0)
    yield INTERRUPT
    INTERRUPT.arm(0)


def valid_slots(cache, b):
    """Slots holding sequence b's tokens: the sinks, then the ring from its head."""
    L, nk, W = cache.length(b), cache.n_keep, cache.capacity - cache.n_keep
    head = int(cache.head[b])
    return list(range(min(nk, L))) + [nk + (head - nk + i) % W for i in range(max(0, L - nk))]


def state(cache):
    out = {"lengths": cache.lengths.tolist(), "head": cache.head.tolist(), "seen": cache.seen.tolist(),
           "tokens": [list(t) for t in cache.tokens]}
    for b in range(cache.batch):
        s = valid_slots(cache, b)
        out["positions", b] = cache.positions[b, s].copy()
        out["rotations", b] = cache.rotations[b, s].copy()
        for l in range(cache.n_layers):
            out["k", l, b] = KVCache.keys(cache, l, b, length=cache.capacity)[:, s].copy()
            out["v", l, b] = KVCache.values(cache, l, b, length=cache.capacity)[:, s].copy()
    return out


def assert_same(a, b, what):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (what, key)
        else:
            assert x == y, (what, key, x, y)


MODEL = dict(position="rope", style="neox", n_layers=2, seed=11)
PROMPTS = ([3, 14, 15, 9, 2], [6, 5, 35, 8, 9, 7, 9, 3, 2])
STEPS = np.random.default_rng(12).integers(0, V, (2, 40))


def new_cache(policy, dtype):
    return SpyCache(2, 2, 8, 14, batch=2, dtype=dtype, n_keep=2, policy=policy)


def prepare(dec, policy, dtype, n_steps):
    cache = new_cache(policy, dtype)
    for b, p in enumerate(PROMPTS):
        dec.prefill(p, cache=cache, seq=b)
    for i in range(n_steps):
        dec.step(STEPS[:, i], cache=cache)
    return cache


@pytest.mark.parametrize("policy, dtype", [("reevaluate", "float16"), ("shift", "float16"),
                                           ("sink_query", "float32"), ("fixed", "float16"),
                                           ("shift", "float32")])
def test_interrupted_step_leaves_the_cache_as_it_was(policy, dtype, interruptible):
    dec = random_decoder(**MODEL)
    # step n0 finds sequence 1 (9 prompt tokens) full in a 14-slot cache: the step discards first
    # (under "fixed": the last step that fits, so n0 = 4 steps the cache to 13 and 14 tokens)
    n0, more = (5, 6) if policy != "fixed" else (4, 1)
    want = []
    cache = prepare(dec, policy, dtype, n0)
    for i in range(n0, n0 + more):
        want.append(dec.step(STEPS[:, i], cache=cache))
    k, interrupted = 0, 0
    while True:
        k += 1
        cache = prepare(dec, policy, dtype, n0)
        before = state(cache)
        interruptible.arm(k)
        try:
            dec.step(STEPS[:, n0], cache=cache)
        except KeyboardInterrupt:
            pass
        if not interruptible.disarm():
            break                                   # k is past the step's last call
        interrupted += 1
        assert_same(state(cache), before, "policy %s, interrupt at call %d" % (policy, k))
        got = [dec.step(STEPS[:, i], cache=cache) for i in range(n0, n0 + more)]
        for g, w in zip(got, want):
            assert np.array_equal(g, w), ("continued generation differs", policy, k)
    assert interrupted >= 10, interrupted          # the step really was interrupted, at many points


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_interrupted_prefill_leaves_the_cache_as_it_was(dtype, interruptible):
    """A prefill runs in chunks (4 tokens here); an interrupt in any chunk undoes the earlier ones."""
    dec = random_decoder(**MODEL)
    dec.prefill_chunk = 4
    prompt = list(STEPS[0, :11])

    def start():
        cache = new_cache("shift", dtype)
        dec.prefill(PROMPTS[0], cache=cache, seq=0)
        dec.prefill(PROMPTS[1][:3], cache=cache, seq=1)
        return cache

    cache = start()
    want = dec.prefill(prompt, cache=cache, seq=1, all_logits=True)
    want_step = dec.step(STEPS[:, 20], cache=cache)
    k, interrupted = 0, 0
    while True:
        k += 1
        cache = start()
        before = state(cache)
        interruptible.arm(k)
        try:
            dec.prefill(prompt, cache=cache, seq=1, all_logits=True)
        except KeyboardInterrupt:
            pass
        if not interruptible.disarm():
            break
        interrupted += 1
        assert_same(state(cache), before, "prefill, interrupt at call %d" % k)
        assert np.array_equal(dec.prefill(prompt, cache=cache, seq=1, all_logits=True), want)
        assert np.array_equal(dec.step(STEPS[:, 20], cache=cache), want_step)
    assert interrupted >= 10, interrupted
