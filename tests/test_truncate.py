"""KVCache.truncate (rollback): after dropping the newest tokens, later steps must give the logits
of a fresh cache fed only the kept tokens, under every policy, before and after the ring wraps,
with other sequences of the batch untouched, and inside/outside transactions.

References: a one-layer model's K/V depend only on token and position, so a fresh prefill of the
kept tokens is the cache a policy should leave (as in test_streaming.py); the kept tokens
themselves come from a plain-list model of each policy written here.  Multi-layer models (no
wrap) are checked against transformers on the kept sequence.  Bound: 1e-4 of the largest
|logit| (float32 cache), as in test_streaming.py.
"""
import numpy as np
import pytest

from kvsimd import KVSimdError, KVSimdTypeError, KVSimdValueError
from kvsimd.observe import Observer, observe

from test_streaming import V, fresh, random_decoder, rel

C, NK, ND = 24, 4, 6
TOL = 1e-4


class Policy:
    """The tokens a cache of each policy holds, as a plain list (the reference bookkeeping)."""

    def __init__(self, policy, capacity=C, n_keep=NK, n_discard=ND):
        self.policy, self.C, self.nk, self.nd, self.toks = policy, capacity, n_keep, n_discard, []

    def step(self, t):
        if len(self.toks) == self.C:
            assert self.policy != "fixed"
            drop = 1 if self.policy == "sink_query" else self.nd
            del self.toks[self.nk:self.nk + drop]
        self.toks.append(int(t))

    def truncate(self, n):
        del self.toks[len(self.toks) - n:]


def new(dec, policy, batch=1):
    kw = dict(n_keep=NK, n_discard=ND) if policy != "fixed" else {}
    return dec.new_cache(batch=batch, capacity=C, dtype="float32", policy=policy, **kw)


POLICIES = ["fixed", "reevaluate", "shift", "sink_query"]
MODELS = {"rope": dict(position="rope", style="neox"), "alibi": dict(position="alibi")}


def steps_match_fresh(dec, cache, ref, toks):
    """Step ``toks`` into ``cache`` (batch 1), each step's logits against a fresh prefill of the kept tokens."""
    for t in toks:
        ref.step(t)
        got = dec.step([t], cache=cache)[0]
        assert cache.tokens[0] == ref.toks
        assert rel(got, fresh(dec, ref.toks)) <= TOL


# (steps after the prompt of 10 before truncating, n): before any wrap, and after one where the
# dropped slots run across the end of the ring, up to the whole window (and, where allowed, the sinks)
CASES = [(5, 1), (5, 3), (8, 15), (14, 14), (30, 2), (37, 5), (41, 9), (45, 20), (33, 24)]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("policy,before,n", [(p, b, n) for p in POLICIES for b, n in CASES
                                             if p != "fixed" or 10 + b <= C])   # a fixed cache holds 24
def test_later_steps_equal_a_fresh_cache_of_the_kept_tokens(model, policy, before, n):
    dec = random_decoder(**MODELS[model])
    toks = np.random.default_rng(before * 31 + n).integers(0, V, 10 + before + 12)
    cache, ref = new(dec, policy), Policy(policy)
    dec.prefill(toks[:10], cache=cache)
    ref.toks = [int(t) for t in toks[:10]]
    for t in toks[10:10 + before]:
        dec.step([t], cache=cache)
        ref.step(t)
    assert cache.tokens[0] == ref.toks
    L = len(ref.toks)
    wrapped = cache.seen[0] != L or cache.head[0] != NK
    limit = L - NK if (wrapped and policy == "sink_query") else L
    if n > limit:
        with pytest.raises(KVSimdValueError, match=r"n must be in 0\.\.%d .*got %d" % (limit, n)):
            cache.truncate(0, n)
        assert cache.tokens[0] == ref.toks
        n = limit
    seen = int(cache.seen[0])
    cache.truncate(0, n)
    ref.truncate(n)
    assert cache.tokens[0] == ref.toks and cache.length(0) == L - n
    assert cache.seen[0] == (seen - n if ref.toks else 0)
    rest = toks[10 + before:] if policy != "fixed" else toks[10 + before:][:C - len(ref.toks)]
    if not ref.toks:              # emptied: a fresh sequence, which a prefill starts again
        assert cache.head[0] == NK and cache.seen[0] == 0
        assert rel(dec.prefill(rest[:2], cache=cache), fresh(dec, list(rest[:2]))) <= TOL
        ref.toks, rest = [int(t) for t in rest[:2]], rest[2:]
    elif wrapped and policy in ("shift", "sink_query"):
        assert cache.head[0] != NK          # the case runs with a wrapped ring
    steps_match_fresh(dec, cache, ref, rest)


@pytest.mark.parametrize("policy", POLICIES)
def test_other_sequences_of_the_batch_are_untouched(policy):
    dec = random_decoder()
    rng = np.random.default_rng(5)
    toks = rng.integers(0, V, (2, 60))
    cache = new(dec, policy, batch=2)
    refs = [Policy(policy), Policy(policy)]
    for b in range(2):
        dec.prefill(toks[b, :8], cache=cache, seq=b)
        refs[b].toks = [int(t) for t in toks[b, :8]]
    n_steps = 12 if policy == "fixed" else 30      # streaming: both wrap
    for i in range(8, 8 + n_steps):
        dec.step(toks[:, i], cache=cache)
        for b in range(2):
            refs[b].step(toks[b, i])
    before = state(cache, 0, C)
    cache.truncate(1, 3)
    refs[1].truncate(3)
    assert state(cache, 0, C) == before
    assert cache.tokens[1] == refs[1].toks
    for i in range(8 + n_steps, 8 + n_steps + 4):
        got = dec.step(toks[:, i], cache=cache)
        for b in range(2):
            refs[b].step(toks[b, i])
            assert cache.tokens[b] == refs[b].toks
            assert rel(got[b], fresh(dec, refs[b].toks)) <= TOL, (policy, b)


class Boom(Observer):
    """Fails the next decoder pass after its K/V were committed (the transaction must undo it)."""

    def positions(self, part, n):
        raise RuntimeError("boom")


def held_slots(cache, b):
    """Slots of the tokens sequence b holds, oldest first: the sinks, then the ring from its head."""
    L, nk, W, h = cache.length(b), cache.n_keep, cache.capacity - cache.n_keep, int(cache.head[b])
    return list(range(min(L, nk))) + [nk + (h - nk + i) % W for i in range(max(L - nk, 0))]


def state(cache, b=0, length=None):
    """Everything the cache keeps for sequence b: K/V of the held slots (or of the first ``length``)."""
    slots = held_slots(cache, b) if length is None else list(range(length))
    C = cache.capacity
    return (cache.tokens[b], cache.length(b), int(cache.head[b]), int(cache.seen[b]),
            cache.positions[b].tolist(), cache.rotations[b].tolist(),
            [np.array(cache.keys(l, b, C))[:, slots].tolist() for l in range(cache.n_layers)],
            [np.array(cache.values(l, b, C))[:, slots].tolist() for l in range(cache.n_layers)])


WRAPS = [(p, w) for p in POLICIES for w in (False, True) if p != "fixed" or not w]    # a fixed cache never wraps


@pytest.mark.parametrize("policy,wrap", WRAPS)
def test_a_failing_step_after_truncate_leaves_the_truncated_state(policy, wrap):
    dec = random_decoder(n_layers=2)
    toks = np.random.default_rng(7).integers(0, V, 60)
    cache = new(dec, policy)
    dec.prefill(toks[:10], cache=cache)
    for t in toks[10:40 if wrap else 14]:
        dec.step([t], cache=cache)
    cache.truncate(0, 3)
    want = state(cache)
    for t in toks[40:43]:       # the first of these fills the freed slots, a later one may discard
        with pytest.raises(RuntimeError, match="boom"), observe(dec, Boom()):
            dec.step([t], cache=cache)
        assert state(cache) == want
    # and the cache goes on as if the failed steps never happened
    other = new(dec, policy)
    dec.prefill(toks[:10], cache=other)
    for t in toks[10:40 if wrap else 14]:
        dec.step([t], cache=other)
    other.truncate(0, 3)
    for t in toks[43:50]:
        assert np.array_equal(dec.step([t], cache=cache), dec.step([t], cache=other))


@pytest.mark.parametrize("policy,wrap", WRAPS)
def test_truncate_inside_a_failed_transaction_is_undone(policy, wrap):
    """Inside a transaction the truncate and the steps that overwrite the freed slots are undone
    together, down to the bookkeeping of every slot."""
    dec = random_decoder(n_layers=2)
    toks = np.random.default_rng(8).integers(0, V, 60)
    cache = new(dec, policy)
    dec.prefill(toks[:10], cache=cache)
    for t in toks[10:40 if wrap else 14]:
        dec.step([t], cache=cache)
    want = state(cache)
    with pytest.raises(RuntimeError, match="inside"):
        with cache.transaction():
            dec.step([toks[40]], cache=cache)
            cache.truncate(0, 4)
            for t in toks[41:47]:
                dec.step([t], cache=cache)
            raise RuntimeError("inside")
    assert state(cache) == want       # positions and rotations of every slot included


def test_multi_layer_models_match_transformers_on_the_kept_sequence():
    from test_models import causal, hf_logits
    m, d = causal("llama")
    toks = list(np.random.default_rng(3).integers(0, 97, 40))
    cache = d.new_cache(capacity=64, dtype="float32")
    d.prefill(toks[:12], cache=cache)
    for t in toks[12:25]:
        d.step([t], cache=cache)
    cache.truncate(0, 6)          # keeps toks[:19]
    kept = toks[:19]
    for t in toks[25:32]:
        kept.append(t)
        got = d.step([t], cache=cache)[0]
        assert rel(got, hf_logits(m, kept)[-1]) <= TOL
    # a prefill continues after a truncated (never wrapped) sequence
    cache.truncate(0, 3)
    kept = kept[:-3] + toks[32:36]
    got = d.prefill(toks[32:36], cache=cache, all_logits=True)
    assert rel(got, hf_logits(m, kept)[-4:]) <= TOL


def test_bad_arguments_name_seq_and_n_and_change_nothing():
    dec = random_decoder()
    cache = new(dec, "sink_query", batch=2)
    toks = np.random.default_rng(9).integers(0, V, (2, 40))
    dec.prefill(toks[0, :6], cache=cache, seq=0)
    dec.prefill(toks[1, :6], cache=cache, seq=1)
    before = [state(cache, b) for b in range(2)]
    for seq, n, err, pat in [(2, 1, KVSimdValueError, r"seq must be in 0\.\.1, got 2"),
                             (-1, 1, KVSimdValueError, "seq"), ("0", 1, KVSimdTypeError, "seq"),
                             (0, -1, KVSimdValueError, r"n must be in 0\.\.6 for sequence 0 .*got -1"),
                             (0, 7, KVSimdValueError, r"n must be in 0\.\.6 for sequence 0 \(it holds 6 tokens\), "
                                                      r"got 7"),
                             (1, 2.0, KVSimdTypeError, "n"), (1, None, KVSimdTypeError, "n")]:
        with pytest.raises(err, match=pat):
            cache.truncate(seq, n)
        assert [state(cache, b) for b in range(2)] == before
    assert issubclass(KVSimdValueError, KVSimdError)
    cache.truncate(0, 0)          # nothing to drop is allowed
    assert [state(cache, b) for b in range(2)] == before
    # a wrapped sink_query ring keeps its sinks
    for i in range(6, 40):
        dec.step(toks[:, i], cache=cache)
    with pytest.raises(KVSimdValueError, match=r"0\.\.%d for sequence 1 .*%d of them sinks.*got %d" % (C - NK, NK, C)):
        cache.truncate(1, C)
    cache.truncate(1, C - NK)
    assert cache.tokens[1] == [int(t) for t in toks[1, :NK]]


def test_truncate_makes_older_plans_stale():
    dec = random_decoder()
    cache = new(dec, "fixed")
    dec.prefill(np.arange(5), cache=cache)
    plan = cache.begin_step(np.array([3]), rope=dec.rope, n_heads=dec.cfg.n_heads)
    cache.truncate(0, 1)
    with pytest.raises(KVSimdValueError, match="stale plan"):
        cache.end_step(plan)
