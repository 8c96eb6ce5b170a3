"""Issue 14 review: the new core API (KVCache plans and transactions, Layers.run, _local_plan)
driven as a careless or hostile caller would.  Each case runs in one child process
(tests/childcases.py), so a crash fails a case instead of the run; each must end in a
KVSimdError naming what was wrong, with the cache's bookkeeping and K/V exactly as before."""
import numpy as np
import pytest

import childcases

CASES = {}
case = childcases.registrar(CASES)
child_results = childcases.results_fixture(__name__, CASES)

STALE = r"stale plan: the cache changed since (begin_step|begin_prefill|step_plan) made it"


def _decoder():
    from kvsimd.testing import random_decoder
    return random_decoder(64, 32, 2, 4, 2, 8, 48, seed=1)


def _cache(d, capacity=16, **kw):
    return d.new_cache(capacity=capacity, **kw)


def _prefill(d, c, n=4, seq=0):
    t = np.arange(1, n + 1, dtype=np.int64)
    p = c.begin_prefill(seq, t, rope=d.rope, n_heads=4)
    d._packed.layers.run(d._embed(t, p.embed_positions), p)
    c.end_prefill(p)
    return p


def _step(d, c, tok=5):
    """begin_step + the layers (no end_step): the plan of a step whose K/V are written."""
    t = np.full(c.batch, tok, np.int64)
    p = c.begin_step(t, rope=d.rope, n_heads=4)
    d._packed.layers.run(d._embed(t, p.embed_positions), p)
    return p


def _state(c):
    kv = [(np.array(c.keys(l, b, length=c.capacity)), np.array(c.values(l, b, length=c.capacity)))
          for l in range(c.n_layers) for b in range(c.batch)]
    return (c.lengths.tolist(), c.tokens, c.head.tolist(), c.seen.tolist(), c.positions.tolist(),
            c.rotations.tolist(), kv)


def _refused_intact(c, fn):
    """fn() must raise a KVSimdError and leave every committed thing of ``c`` as it was."""
    from kvsimd import KVSimdError
    before = _state(c)
    try:
        fn()
    except KVSimdError:
        after = _state(c)
        assert after[:4] == before[:4], "bookkeeping changed by a refused call: %s -> %s" % (before[:4], after[:4])
        n = before[0]
        for (k0, v0), (k1, v1), b in zip(before[6], after[6], list(range(c.batch)) * c.n_layers):
            assert np.array_equal(k0[:, :n[b]], k1[:, :n[b]]) and np.array_equal(v0[:, :n[b]], v1[:, :n[b]]), \
                "committed K/V changed by a refused call"
        raise
    raise AssertionError("no error: lengths %s tokens %s (before: %s %s)" % (c.lengths, c.tokens, before[0], before[1]))


# ---------------------------------------------------------------- stale plans
@case(STALE)
def end_step_twice():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = _step(d, c); c.end_step(p)
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def end_prefill_twice():
    d = _decoder(); c = _cache(d); p = _prefill(d, c)
    _refused_intact(c, lambda: c.end_prefill(p))


@case(STALE)
def end_step_after_reset():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = _step(d, c); c.reset()
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def layers_run_after_reset():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4); c.reset(0)
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p))


@case(STALE)
def end_prefill_after_reset():
    d = _decoder(); c = _cache(d)
    p = c.begin_prefill(0, np.arange(1, 5, dtype=np.int64), rope=d.rope, n_heads=4); c.reset()
    _refused_intact(c, lambda: c.end_prefill(p))


@case(STALE)
def end_step_after_another_step_committed():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p1 = _step(d, c, 5); p2 = _step(d, c, 6); c.end_step(p2)
    _refused_intact(c, lambda: c.end_step(p1))


@case(STALE)
def end_step_after_prefill_of_another_sequence():
    d = _decoder(); c = _cache(d, batch=2); _prefill(d, c, seq=0); _prefill(d, c, seq=1)
    p = _step(d, c); _prefill(d, c, 2, seq=1)
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def end_step_after_forget():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = _step(d, c); c._forget(0, 4)
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def end_step_after_commit():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = _step(d, c); c.commit(1)
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def end_step_after_rollback():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    try:
        with c.transaction():
            p = _step(d, c)
            raise RuntimeError("the caller's failure")
    except RuntimeError:
        pass
    _refused_intact(c, lambda: c.end_step(p))


@case(STALE)
def end_step_after_sink_query_discard():
    # sink_query: each begin_step on a full window discards the oldest token; ending the first
    # plan after the second discard committed 9 tokens into a cache of 8
    d = _decoder(); c = _cache(d, capacity=8, policy="sink_query", n_keep=2); _prefill(d, c, 8)
    p1 = _step(d, c, 5); p2 = _step(d, c, 6); c.end_step(p2)
    _refused_intact(c, lambda: c.end_step(p1))


@case(STALE)
def layers_run_after_shift_discard():
    d = _decoder(); c = _cache(d, capacity=8, policy="shift", n_keep=2, n_discard=1); _prefill(d, c, 8)
    p1 = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    p2 = _step(d, c, 6); c.end_step(p2)
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p1))


@case(STALE)
def step_plan_after_commit():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    one = np.array([4], np.int64)
    p = c.step_plan(32, one, one, one, [[(False, 0, 5, 4)]], rope=d.rope)
    c.reset()
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p))


@case(r"plan of begin_step on this cache")
def end_step_with_plan_of_another_cache():
    d = _decoder(); c = _cache(d); c2 = _cache(d); _prefill(d, c); _prefill(d, c2)
    p = _step(d, c)
    _refused_intact(c2, lambda: c2.end_step(p))


@case(r"begin_step on this cache")
def end_step_with_prefill_plan():
    d = _decoder(); c = _cache(d)
    p = c.begin_prefill(0, np.arange(1, 5, dtype=np.int64), rope=d.rope, n_heads=4)
    _refused_intact(c, lambda: c.end_step(p))


# ---------------------------------------------------------------- transactions
@case(r"transaction .*(already|not) (entered|open)")
def transaction_exited_twice():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    t = c.transaction(); t.__enter__(); t.__exit__(None, None, None)
    t.__exit__(None, None, None)


@case(r"transaction .*not (entered|open)")
def transaction_exit_without_enter_keeps_the_callers_claim():
    # an unmatched __exit__ released a claim the caller held (another thread could then step)
    d = _decoder(); c = _cache(d); _prefill(d, c)
    with c._claim():
        c.transaction().__exit__(None, None, None)


@case(r"transaction .*already (entered|open)")
def transaction_object_entered_twice():
    # re-entering one transaction object made it forget it was the outer one: the cache kept it
    # open for ever and no later transaction rolled anything back
    d = _decoder(); c = _cache(d); _prefill(d, c)
    t = c.transaction()
    with t:
        with t:
            pass


def test_rollback_works_after_a_refused_reentry():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    from kvsimd import KVSimdError
    t = c.transaction()
    with pytest.raises(KVSimdError):
        with t:
            with t:
                pass
    before = _state(c)
    with pytest.raises(RuntimeError):
        with c.transaction():
            c.end_step(_step(d, c))
            raise RuntimeError("fail")
    assert _state(c)[:4] == before[:4]


def test_nested_transactions_still_join_the_outer_one():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    before = _state(c)
    with pytest.raises(RuntimeError):
        with c.transaction():
            with c.transaction():
                c.end_step(_step(d, c))
            raise RuntimeError("fail")
    assert _state(c)[:4] == before[:4]


# ---------------------------------------------------------------- Layers.run inputs
@case(r"cross must be None for layers without cross-attention, got CrossAttentionCache")
def cross_cache_to_layers_without_cross_attention():
    # crashed (SIGSEGV): the blocks have no norm_cross / cross_q
    from kvsimd import _kvsimd
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    cr = _kvsimd.CrossAttentionCache(2, 2, 8, 4, dtype="float32")
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p, cr))


@case(r"T \(rows of the pass\) must be in 1\.\.\d+, got 0")
def local_plan_without_rows():
    from kvsimd import _kvsimd
    d = _decoder()
    _kvsimd._local_plan(0, 4, 2, 8, d.rope, None, True)


@case(r"T \(rows of the pass\) must be in 1\.\.\d+, got 1099511627776")
def local_plan_huge():
    from kvsimd import _kvsimd
    d = _decoder()
    _kvsimd._local_plan(2 ** 40, 4, 2, 8, d.rope, None, True)


@case(r"end_step: the plan's K/V were written for 0 of the cache's 2 layers")
def end_step_before_the_layers_ran():
    # committed a token whose slot still held old contents (zeros, or a discarded token's K/V)
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    _refused_intact(c, lambda: c.end_step(p))


@case(r"end_prefill: the plan's K/V were written for 1 of the cache's 2 layers")
def end_prefill_after_one_layer():
    from kvsimd import _kvsimd
    d = _decoder(); c = _cache(d)
    t = np.arange(1, 5, dtype=np.int64)
    p = c.begin_prefill(0, t, rope=d.rope, n_heads=4)
    full = d._packed.layers
    one = _kvsimd.Layers(full.blocks[:1], d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, activation="silu",
                         gated=full.gated, pre_norm=full.pre_norm, parallel_residual=full.parallel)
    one.run(d._embed(t, p.embed_positions), p)
    _refused_intact(c, lambda: c.end_prefill(p))


def _holder(c, action=None):
    """A thread that holds ``c`` (its claim) until released, then runs ``action`` under it."""
    import threading
    held, go = threading.Event(), threading.Event()

    def body():
        with c._claim():
            held.set()
            go.wait(30)
            if action is not None:
                action()
    th = threading.Thread(target=body)
    th.start()
    assert held.wait(30)
    return go, th


@case(STALE)
def layers_run_while_another_thread_steps_the_cache():
    from kvsimd import KVSimdBusyError
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    go, th = _holder(c, lambda: c.end_step(_step(d, c, 7)))
    try:
        with pytest.raises(KVSimdBusyError, match="in use by thread"):
            d._packed.layers.run(np.zeros((1, 32), np.float32), p)
    finally:
        go.set(); th.join()
    assert c.tokens == [[1, 2, 3, 4, 7]]
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p))


@case(r"in use by thread")
def transaction_from_two_threads():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    go, th = _holder(c)
    try:
        _refused_intact(c, lambda: c.transaction().__enter__())
    finally:
        go.set(); th.join()


OVERWRITTEN = r"another plan .*wrote .* after this one"


@case(OVERWRITTEN)
def end_step_after_another_plan_overwrote_its_slots():
    # two plans of one state share the next slot: the one run last owns the K/V there, so
    # ending the other committed token 7 with the K/V of token 5
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p7 = _step(d, c, 7)
    _step(d, c, 5)
    _refused_intact(c, lambda: c.end_step(p7))


@case(r"end_step: the plan's K/V were written for 0 of the cache's 2 layers")
def end_step_unrun_after_a_write_before_the_plan():
    # K/V stored with write() count as a plan's only when written after the plan was made
    d = _decoder(); c = _cache(d)
    z = np.ones((2, 4, 8), np.float32)
    for layer in range(2):
        c.write(layer, z, z)
    c.commit(4)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    _refused_intact(c, lambda: c.end_step(p))


def test_prefill_plan_filled_with_write_is_accepted():
    """The low-level way (kvsimd.bench.streaming): a prefill plan's bookkeeping, K/V the caller
    stores with write(), end_prefill."""
    d = _decoder(); c = _cache(d, dtype="float32")
    rng = np.random.default_rng(3)
    kv = [(rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((2, 5, 8)).astype(np.float32))
          for _ in range(2)]
    p = c.begin_prefill(0, np.arange(1, 6, dtype=np.int64), rope=d.rope, n_heads=4)
    for layer, (k, v) in enumerate(kv):
        c.write(layer, k, v)
    c.end_prefill(p)
    assert c.tokens == [[1, 2, 3, 4, 5]]
    for layer, (k, v) in enumerate(kv):
        assert np.array_equal(c.keys(layer), k) and np.array_equal(c.values(layer), v)
    d.step([6], cache=c)
    assert c.length(0) == 6


class _Hooked(np.ndarray):
    """A weight whose matrix products call ``hook`` first (a caller-supplied array subclass is the
    one point where Python runs inside Layers.run)."""
    hook = None

    def __array_ufunc__(self, ufunc, method, *args, **kw):
        if _Hooked.hook is not None:
            h, _Hooked.hook = _Hooked.hook, None
            h()
        args = tuple(np.asarray(a) if isinstance(a, _Hooked) else a for a in args)
        return getattr(ufunc, method)(*args, **kw)


@case(r"in use by thread")
def another_thread_commits_between_two_layers_of_a_run():
    # Layers.run took the cache per layer only: between two layers another thread could run its
    # own plan of the same slot and commit it, with this run's K/V in some layers
    import threading
    from kvsimd import _kvsimd
    d = _decoder(); c = _cache(d); _prefill(d, c)
    full = d._packed.layers
    blocks = []
    for i, b in enumerate(full.blocks):
        qkv = b.qkv
        if i == 1:
            qkv = _kvsimd.Linear(qkv.w.a.view(_Hooked), None if qkv.b is None else qkv.b.a)
        blocks.append(_kvsimd.Block(b.norm1, qkv, b.o, b.norm2, b.ffn_in, b.ffn_out))
    hooked = _kvsimd.Layers(blocks, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, activation="silu",
                            gated=full.gated, pre_norm=full.pre_norm, parallel_residual=full.parallel)
    p5 = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    errors = []

    def other():
        try:
            c.end_step(_step(d, c, 7))
        except BaseException as e:
            errors.append(e)

    def hook():
        th = threading.Thread(target=other)
        th.start(); th.join()
    _Hooked.hook = hook
    hooked.run(d._embed(np.array([5]), p5.embed_positions), p5)
    assert _Hooked.hook is None, "the hook did not run"
    assert c.tokens == [[1, 2, 3, 4]], c.tokens
    c.end_step(p5)
    assert c.tokens == [[1, 2, 3, 4, 5]]
    raise errors[0]


@case(r"x overlaps layers\[0\]\..*: an output must not share memory")
def layers_run_with_x_a_view_of_a_weight():
    # x is updated in place: a view of a weight made the pass rewrite the model silently
    d = _decoder(); c = _cache(d); _prefill(d, c)
    w = d._packed.layers.blocks[0].o.w.a
    before = w.copy()
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    try:
        _refused_intact(c, lambda: d._packed.layers.run(w[1:2], p))
    finally:
        assert np.array_equal(w, before), "the weight was changed"


@case(r"restore\(\) needs an open outer transaction, this one is closed")
def restore_of_a_closed_transaction():
    # put the ring back to a state that later shift discards had rewritten (keys rotated since)
    d = _decoder(); c = _cache(d, capacity=8, policy="shift", n_keep=2, n_discard=2); _prefill(d, c, 6)
    t = c.transaction()
    with t:
        d.step([7], cache=c)
    for tok in range(8, 14):
        d.step([tok], cache=c)
    _refused_intact(c, t.restore)


@case(r"restore\(\) needs an open outer transaction, this one is not entered yet")
def restore_of_a_transaction_never_entered():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    _refused_intact(c, c.transaction().restore)


@case(r"restore\(\) needs an open outer transaction, this one is nested")
def restore_of_a_nested_transaction():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    with c.transaction():
        with c.transaction() as inner:
            _refused_intact(c, inner.restore)


# ---------------------------------------------------------------- refused already (kept as regressions)
@case(STALE)
def plan_begun_outside_a_transaction_that_rolls_back():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = _step(d, c)
    try:
        with c.transaction():
            c.end_step(p)
            raise RuntimeError("the caller's failure")
    except RuntimeError:
        pass
    assert c.tokens == [[1, 2, 3, 4]]
    _refused_intact(c, lambda: c.end_step(p))


@case(r"tokens must have dtype int64, got float64")
def begin_step_float_tokens():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    _refused_intact(c, lambda: c.begin_step(np.array([5.0]), rope=d.rope, n_heads=4))


@case(r"tokens must be 1-D \[batch\], got shape \(1, 1\)")
def begin_step_2d_tokens():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    _refused_intact(c, lambda: c.begin_step(np.array([[5]]), rope=d.rope, n_heads=4))


@case(r"rope is for head_dim 16, the cache has 8")
def begin_step_rope_of_another_head_dim():
    from kvsimd import _kvsimd
    d = _decoder(); c = _cache(d); _prefill(d, c)
    _refused_intact(c, lambda: c.begin_step(np.array([5]), rope=_kvsimd.RopeSpec(10000.0, "neox", 16, 16), n_heads=4))


@case(r"has wrapped its ring buffer")
def begin_prefill_after_a_wrap():
    d = _decoder(); c = _cache(d, capacity=8, policy="sink_query", n_keep=2); _prefill(d, c, 8)
    d.step([9], cache=c)
    _refused_intact(c, lambda: c.begin_prefill(0, np.array([1], np.int64), rope=d.rope, n_heads=4))


@case(r"slots \[4611686018427387904\] outside 0\.\.15")
def step_plan_extreme_slot():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    big, one = np.array([2 ** 62], np.int64), np.array([4], np.int64)
    _refused_intact(c, lambda: c.step_plan(32, big, one, one, [[(False, 0, 5, 4)]]))


@case(r"keys 0\.\.4611686018427387904 must be non-empty and within 0\.\.16")
def step_plan_extreme_range():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    one = np.array([4], np.int64)
    _refused_intact(c, lambda: c.step_plan(32, one, one, one, [[(False, 0, 2 ** 62, 4)]]))


@case(r"changed in place after the model packed it")
def layers_run_after_a_weight_was_resized():
    d = _decoder(); c = _cache(d); _prefill(d, c)
    w = d._packed.layers.blocks[1].ffn_out.w.a
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    w.resize((w.shape[0] * 2, w.shape[1]), refcheck=False)
    _refused_intact(c, lambda: d._packed.layers.run(np.zeros((1, 32), np.float32), p))


@pytest.mark.parametrize("name", list(CASES))
def test_refused(name, child_results):
    childcases.check(name, child_results, CASES)


def test_model_passes_unchanged():
    """The checks refuse only misuse: prefill, steps and every policy's discards still match the
    float64 reference."""
    from kvsimd.testing import assert_matches_reference
    d = _decoder()
    for policy in ("fixed", "sink_query", "shift", "reevaluate"):
        c = d.new_cache(capacity=8 if policy != "fixed" else 32, n_keep=2, policy=policy)
        d.prefill([1, 2, 3, 4, 5], cache=c)
        for t in range(6, 20):
            d.step([t], cache=c)
        assert c.length(0) <= c.capacity
        assert c.tokens[0][-1] == 19
    c = d.new_cache(capacity=32, dtype="float32")
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = d.prefill(toks, cache=c, all_logits=True)
    assert_matches_reference(d, toks, logits)



def test_plan_tokens_and_positions_are_read_only():
    """end_step records plan.tokens: a caller changing them made the cache's token list disagree
    with its K/V (and "reevaluate" re-prefill the wrong ids)."""
    from kvsimd import _kvsimd
    d = _decoder(); c = _cache(d); _prefill(d, c)
    p = c.begin_step(np.array([5], np.int64), rope=d.rope, n_heads=4)
    q = c.begin_prefill(0, np.array([6], np.int64), rope=d.rope, n_heads=4)
    lp = _kvsimd._local_plan(3, 4, 2, 8, d.rope, None, True)
    for a in (p.tokens, p.embed_positions, q.tokens, q.embed_positions, lp.embed_positions):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 9
    d._packed.layers.run(d._embed(np.array([5]), p.embed_positions), p)
    c.end_step(p)
    assert c.tokens == [[1, 2, 3, 4, 5]] and c.positions[0, 4] == 4


def test_reevaluate_refill_is_read_only():
    """plan.refill says which tokens the caller must prefill again: the caller cannot edit it
    (a changed list would re-prefill other tokens than the cache dropped)."""
    from test_streaming import random_decoder
    d = random_decoder(n_layers=1)
    cache = d.new_cache(capacity=6, policy="reevaluate", n_keep=1, n_discard=2)
    d.prefill([1, 2, 3, 4, 5, 6], cache=cache)
    with cache.transaction():
        plan = cache.begin_step(np.array([7], np.int64), rope=d.rope, n_heads=d.cfg.n_heads)
        assert dict(plan.refill) == {0: (1, 4, 5, 6)}
        with pytest.raises(TypeError):
            plan.refill[0] = (1,)
        with pytest.raises(AttributeError):
            plan.refill[0].append(9)


def test_plan_and_rope_arguments_of_the_wrong_type_are_kvsimd_errors():
    """end_step / end_prefill and begin_step / begin_prefill took typed Cython arguments: None, a
    string or a number was a bare TypeError from Cython, not a KVSimdError naming the argument."""
    from kvsimd import KVSimdTypeError
    from test_streaming import random_decoder
    d = random_decoder(n_layers=1)
    cache = d.new_cache(capacity=8)
    d.prefill([1, 2], cache=cache)
    for bad in (None, "plan", 3):
        with pytest.raises(KVSimdTypeError, match="plan must be a plan of a cache"):
            cache.end_step(bad)
        with pytest.raises(KVSimdTypeError, match="plan must be a plan of a cache"):
            cache.end_prefill(bad)
    for bad in ("neox", 5, (1e4, "neox", 8)):
        with pytest.raises(KVSimdTypeError, match="rope must be a kvsimd.cache.RopeSpec or None"):
            cache.begin_step(np.array([3], np.int64), rope=bad)
        with pytest.raises(KVSimdTypeError, match="rope must be a kvsimd.cache.RopeSpec or None"):
            cache.begin_prefill(0, np.array([3], np.int64), rope=bad)
    assert cache.lengths.tolist() == [2] and cache.tokens == [[1, 2]]
