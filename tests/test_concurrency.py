"""Threads and one cache (issue 13, item 9): a model may be shared between threads, a cache may
not.  A decode step (or prefill) from a second thread while the first is inside one raises
KVSimdBusyError; it never interleaves with the other step and corrupts the cache."""
import threading

import numpy as np
import pytest

from kvsimd import KVCache, KVSimdBusyError

from test_streaming import random_decoder


class _LogCache(KVCache):
    """A KVCache that logs the token of every committed step (end_step runs inside the cache's
    claim, so the log is the commit order)."""

    def __init__(self, *args, **kwargs):
        self.log = []

    def end_step(self, plan):
        KVCache.end_step(self, plan)
        self.log.append(int(plan.tokens[0]))


@pytest.mark.parametrize("policy", ["fixed", "shift", "sink_query"])
def test_two_threads_stepping_one_cache(policy):
    """Two threads step the same cache 60 times each, retrying when it is busy.  Every step either
    completes or raises KVSimdBusyError, and the cache ends exactly as one thread replaying the
    completed steps in commit order leaves it (keys, values, positions of every layer); without
    the busy flag the interleaved steps corrupt the cache."""
    dec = random_decoder(n_layers=3, seed=5)
    kw = dict(capacity=200 if policy == "fixed" else 40, dtype="float32", policy=policy,
              n_keep=0 if policy == "fixed" else 4)
    prompt = [1, 2, 3, 4, 5, 6]
    cfg = dec.cfg
    cache = _LogCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, **kw)
    dec.prefill(prompt, cache=cache)
    order = cache.log
    busy, errors = [0, 0], []

    def worker(w):
        done = 0
        while done < 60:
            try:
                dec.step([7 + w * 20 + done % 20], cache=cache)
                done += 1
            except KVSimdBusyError:
                busy[w] += 1
            except BaseException as e:   # anything else fails the test
                errors.append(e)
                return

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert len(order) == 120 and cache.seen[0] == len(prompt) + 120
    replay = dec.new_cache(**kw)
    dec.prefill(prompt, cache=replay)
    for t in order:
        dec.step([t], cache=replay)
    assert replay.length() == cache.length()
    for layer in range(3):
        np.testing.assert_array_equal(cache.keys(layer), replay.keys(layer))
        np.testing.assert_array_equal(cache.values(layer), replay.values(layer))
    np.testing.assert_array_equal(cache.positions, replay.positions)
    print("busy refusals:", busy)
