"""Findings of an attack on the hardened API (issue 13): each case failed before its fix."""
import contextlib
import copy
import itertools
import pickle

import numpy as np
import pytest

import kvsimd
from kvsimd import KVCache, KVSimdCapacityError, KVSimdError, KVSimdMemoryError, KVSimdTypeError, ops
from kvsimd import threads as kthreads
from kvsimd.nn import sample

from test_streaming import random_decoder


def test_commit_cannot_wrap_the_length():
    c = KVCache(1, 1, 8, 16)
    k = np.ones((1, 5, 8), np.float32)
    c.write(0, k, k)
    c.commit(5)
    with pytest.raises(KVSimdCapacityError, match="cannot commit 9223372036854775807 tokens"):
        c.commit(2 ** 63 - 1)
    assert c.lengths.tolist() == [5]


def test_write_from_a_view_of_the_cache_itself_is_all_or_nothing():
    """k/v may be (reinterpreted) views of the cache's own storage: they are read as they were
    before the call, and nothing is written before both are accepted."""
    c = KVCache(1, 2, 8, 8, dtype="float16")
    x = np.arange(2 * 8 * 8, dtype=np.float32).reshape(2, 8, 8) / 100
    c.write(0, x, -x, start=0)
    c.commit(8)
    v = c.values(0).view(np.float32).reshape(2, 4, 8)
    want_v = v.astype(np.float16)
    c.write(0, np.full((2, 4, 8), 7, np.float32), v, start=0)
    assert (c.keys(0)[:, :4] == 7).all()
    np.testing.assert_array_equal(c.values(0)[:, :4], want_v)


@pytest.mark.parametrize("how", [pickle.dumps, copy.copy, copy.deepcopy])
def test_a_cache_is_not_copied(how):
    with pytest.raises(KVSimdTypeError, match="cannot be pickled or copied"):
        how(KVCache(1, 1, 8, 4))


@pytest.mark.parametrize("ranges", [itertools.repeat((0, 1)), [range(10 ** 10)], [(0, 1)] * 11])
def test_endless_or_oversized_ranges_are_refused(ranges):
    q = np.ones((4, 8), np.float32)
    k = np.ones((2, 10, 8), np.float16)
    with pytest.raises(KVSimdError):
        ops.attend(q, k, k, ranges=ranges)


def test_scratch_too_large_is_a_kvsimd_memory_error(restore_threads):
    kvsimd.set_num_threads(1024)
    k = np.ones((2, 1, 8), np.float16)
    with pytest.raises(KVSimdMemoryError, match="cannot allocate"):
        ops.attend(np.ones((65536, 8), np.float32), k, k)


@pytest.fixture
def restore_threads():
    n = kvsimd.get_num_threads()
    yield
    kvsimd.set_num_threads(n)
    kthreads.use_default_threads()


def test_reevaluate_must_keep_a_token():
    with pytest.raises(KVSimdError, match="capacity must be at least 2"):
        KVCache(1, 1, 8, 1, policy="reevaluate")
    with pytest.raises(KVSimdError, match="n_discard must be in 1..1"):
        KVCache(1, 1, 8, 2, policy="reevaluate", n_discard=2)
    dec = random_decoder()
    with pytest.raises(KVSimdError, match="n_discard must be in 1..1"):
        dec.generate([1, 2], capacity=2, policy="reevaluate", n_discard=2)
    assert len(list(dec.generate([1, 2], max_new_tokens=5, capacity=2, policy="reevaluate"))) == 5


@pytest.mark.parametrize("logits", [np.array(["a", "b"]), [1 + 2j], {"a": 1}, [True, False]])
def test_sample_needs_real_logits(logits):
    with pytest.raises(KVSimdTypeError, match="logits must be an array of real numbers"):
        sample(logits, temperature=1.0)


def test_tiny_temperature_and_huge_logits_sample_the_maximum():
    assert sample(np.array([1.0, 2.0]), temperature=1e-320) == 1
    assert sample(np.array([1e308, -1e308]), temperature=0.5) == 0
    assert list(random_decoder().generate([1, 2], temperature=1e-310, max_new_tokens=3, seed=0)) == \
        list(random_decoder().generate([1, 2], max_new_tokens=3))


@pytest.mark.parametrize("call, match", [
    (lambda d: d.generate(np.zeros((0, 3), np.int64)), "empty batch"),
    (lambda d: d.prefill(range(10 ** 12), cache=d.new_cache()), "more than the 16777216 tokens"),
    (lambda d: d.generate([1, 2], stop_tokens=range(10 ** 12)), "more than the vocabulary's"),
])
def test_empty_or_huge_token_lists_are_refused(call, match):
    with pytest.raises(KVSimdError, match=match):
        call(random_decoder())


@pytest.mark.parametrize("phase", ["prefill", "step"])
def test_interrupt_as_the_step_returns_undoes_it(monkeypatch, phase):
    """A KeyboardInterrupt raised while leaving the step's BLAS scope (after the step committed)
    still leaves the cache as it was: the scope is inside the step's transaction."""
    dec = random_decoder(n_layers=2)
    cache = dec.new_cache(capacity=16, dtype="float32")
    dec.prefill([1, 2, 3], cache=cache)
    before = (cache.lengths.copy(), cache.keys(0).copy(), cache.keys(1).copy(), list(cache.tokens[0]))

    @contextlib.contextmanager
    def scope():
        yield
        raise KeyboardInterrupt

    monkeypatch.setattr(kthreads, "blas_scope", scope)
    with pytest.raises(KeyboardInterrupt):
        if phase == "step":
            dec.step([4], cache=cache)
        else:
            dec.prefill([4, 5], cache=cache)
    assert cache.lengths.tolist() == before[0].tolist() and list(cache.tokens[0]) == before[3]
    np.testing.assert_array_equal(cache.keys(0), before[1])
    np.testing.assert_array_equal(cache.keys(1), before[2])


@pytest.mark.parametrize("policy", ["reevaluate", "shift"])
def test_second_interrupt_during_the_rollback_waits_for_it(monkeypatch, policy):
    """Ctrl-C twice: the first interrupts a discard step, the second arrives while the cache is
    being put back.  The rollback completes, then the KeyboardInterrupt is raised; the cache
    steps on as if nothing had happened."""
    import os
    import signal

    from kvsimd import KVCache

    class SignalCache(KVCache):      # a second SIGINT as the rollback starts restoring K/V
        armed = False

        def _restore_rows(self, *a, **k):    # what the rollback puts K/V back with
            if SignalCache.armed:
                SignalCache.armed = False
                os.kill(os.getpid(), signal.SIGINT)
            return KVCache._restore_rows(self, *a, **k)

    dec = random_decoder(n_layers=2)
    cache = SignalCache(2, dec.cfg.n_kv_heads, dec.cfg.head_dim, 12, dtype="float32", policy=policy, n_keep=2)
    dec.prefill(list(range(1, 13)), cache=cache)       # the window is full: the next step discards
    before = [(cache.keys(l).copy(), cache.values(l).copy()) for l in range(2)]
    state = (cache.lengths.tolist(), cache.head.tolist(), cache.seen.tolist(), list(cache.tokens[0]),
             cache.positions.copy())
    real_matmul = np.matmul
    calls = {"n": 0}

    def interrupting_matmul(*a, **k):        # the step's layers: interrupted half-way
        calls["n"] += 1
        if calls["n"] == 3:
            SignalCache.armed = True
            raise KeyboardInterrupt
        return real_matmul(*a, **k)

    monkeypatch.setattr(np, "matmul", interrupting_matmul)
    with pytest.raises(KeyboardInterrupt):
        dec.step([5], cache=cache)
    monkeypatch.undo()
    assert not SignalCache.armed              # the second SIGINT was sent during the rollback
    assert (cache.lengths.tolist(), cache.head.tolist(), cache.seen.tolist(), list(cache.tokens[0])) == state[:4]
    np.testing.assert_array_equal(cache.positions, state[4])
    for l in range(2):
        np.testing.assert_array_equal(cache.keys(l), before[l][0])
        np.testing.assert_array_equal(cache.values(l), before[l][1])
    dec.step([5], cache=cache)


def test_cache_memory_check_counts_bookkeeping_and_what_is_available():
    """The cache is zero-filled at once and its bookkeeping grows with batch x capacity: a cache
    whose storage is small but whose bookkeeping would not fit (1 GiB of fp16 for 2**28
    sequences, ~37 GiB of positions) is refused instead of being OOM-killed half-way."""
    with pytest.raises(KVSimdMemoryError, match="with its bookkeeping"):
        KVCache(1, 1, 1, 1, batch=2 ** 28)
