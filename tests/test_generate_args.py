"""generate() and sample(): every argument checked when generate is called, before any prefill runs;
NaN logits are an error; stop tokens end a stream without being yielded; a full "fixed" cache is
an error, not a silent stop."""
import math

import numpy as np
import pytest

from kvsimd import KVSimdCapacityError, KVSimdError
from kvsimd.nn import sample

from test_decoder_safety import random_encoder_decoder
from test_streaming import V, random_decoder

PROMPT = [3, 14, 15, 9, 2]

BAD = [  # (keyword arguments, pattern the message must match)
    (dict(temperature=-0.5), r"temperature must be finite and >= 0 .*got -0\.5"),
    (dict(temperature=math.nan), r"temperature must be finite and >= 0 .*got nan"),
    (dict(temperature=math.inf), r"temperature must be finite .*got inf"),
    (dict(temperature="hot"), r"temperature must be a real number, got 'hot'"),
    (dict(temperature=None), r"temperature must be a real number, got None"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] .*got 0\.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] .*got 1\.5"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\] .*got nan"),
    (dict(top_k=-1), r"top_k must be >= 0 .*got -1"),
    (dict(top_k=2.5), r"top_k must be an integer, got 2\.5"),
    (dict(top_k=True), r"top_k must be an integer, got True"),
    (dict(max_new_tokens=-1), r"max_new_tokens must be >= 0, got -1"),
    (dict(max_new_tokens=2.0), r"max_new_tokens must be an integer, got 2\.0"),
    (dict(seed=1.5), r"seed must be an integer, got 1\.5"),
    (dict(seed="x"), r"seed must be an integer, got 'x'"),
    (dict(seed=-3), r"seed must be None or an integer >= 0, got -3"),
    (dict(stop_tokens=5), r"stop_tokens must be a list of token ids, got 5"),
    (dict(stop_tokens="ab"), r"stop_tokens must be a list of token ids, got 'ab'"),
    (dict(stop_tokens=[1.5]), r"stop_tokens must be integer token ids, got dtype float64"),
    (dict(stop_tokens=[V + 3]), r"stop_tokens contain ids outside the vocabulary 0..52: \[56\]"),
    (dict(stop_tokens=[[1]]), r"stop_tokens must be a non-empty 1-D sequence of integer token ids"),
    (dict(capacity=0), r"capacity=0 is smaller than prompt 0 \(5 tokens\)"),
    (dict(capacity=3), r"capacity=3 is smaller than prompt 0 \(5 tokens\)"),
    (dict(capacity="big"), r"capacity must be an integer, got 'big'"),
    (dict(cache_dtype="int16"),
     r"dtype must be float16, float32, int8, int4 or \"int8/int4\" \(int8 keys, int4 values\), got 'int16'"),
    (dict(n_keep=-1), r"n_keep must be in 0..capacity-1"),
    (dict(capacity=8, n_keep=8, policy="shift"), r"n_keep must be in 0..capacity-1=7, got 8"),
    (dict(policy="lru"), r"policy must be one of .*got 'lru'"),
    (dict(policy=None), r"policy must be one of .*got None"),
    (dict(capacity=8, policy="shift", n_discard=0), r"n_discard must be in 1..8"),
    (dict(prompt=[]), r"prompt must not be empty"),
    (dict(prompt=[[]]), r"prompt\[0\] must be a non-empty 1-D sequence of integer token ids, got \[\]"),
    (dict(prompt=[1, [2]]), r"prompt mixes token ids and lists of token ids"),
    (dict(prompt="abc"), r"prompt must be a list of token ids or a list of such lists, got 'abc'"),
    (dict(prompt=None), r"prompt must be a list of token ids or a list of such lists, got None"),
    (dict(prompt=[1, V]), r"prompt contain ids outside the vocabulary 0..52: \[53\]"),
    (dict(prompt=[1.0, 2.0]), r"prompt must be integer token ids, got dtype float64"),
    (dict(prompt=[[1], [2, 3.5]]), r"prompt\[1\] must be integer token ids, got dtype float64"),
    (dict(prompt=[[1, [2]]]), r"prompt\[0\] must be a non-empty 1-D sequence of integer token ids"),
]


@pytest.fixture
def spied(monkeypatch):
    """The model, with its prefill counting calls."""
    dec = random_decoder(position="rope")
    calls = []
    real = dec._prefill
    monkeypatch.setattr(dec, "_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    return dec, calls


@pytest.mark.parametrize("i", range(len(BAD)))
def test_generate_refuses_a_bad_argument_when_called(i, spied):
    dec, calls = spied
    kw, pattern = dict(BAD[i][0]), BAD[i][1]
    prompt = kw.pop("prompt", PROMPT)
    with pytest.raises(KVSimdError, match=pattern):
        dec.generate(prompt, max_new_tokens=kw.pop("max_new_tokens", 4), **kw)     # no next(): the call itself
    assert calls == []


def test_generate_refuses_positions_the_model_does_not_have():
    dec = random_decoder(position="learned")      # 8192 learned positions
    with pytest.raises(KVSimdError, match=r"position 8192 is beyond the 8192 positions this model has"):
        dec.generate(PROMPT, max_new_tokens=8189)
    # the last new token is never fed back: 8188 of them after 5 prompt tokens reach position 8191
    dec.generate(PROMPT, max_new_tokens=8188)
    # a window that never fills keeps positions below its capacity
    gen = dec.generate(PROMPT, max_new_tokens=8196, capacity=64, policy="reevaluate")
    assert len([next(gen) for _ in range(3)]) == 3


@pytest.mark.parametrize("kw, pattern", [
    (dict(decoder_start=V), r"decoder_start contain ids outside the vocabulary 0..52: \[53\]"),
    (dict(temperature=-1.0), r"temperature must be finite and >= 0"),
    (dict(src=[]), r"src must not be empty"),
    (dict(src=[[5], [6, [7]]]), r"src\[1\] must be a non-empty 1-D sequence of integer token ids"),
    (dict(src=list(range(3, 50)) * 2), r"src of 94 tokens exceeds the encoder's 64 positions"),
    (dict(stop_tokens=[-1]), r"stop_tokens contain ids outside the vocabulary"),
])
def test_encoder_decoder_generate_refuses_a_bad_argument_when_called(kw, pattern, monkeypatch):
    m = random_encoder_decoder()
    calls = []
    monkeypatch.setattr(m, "encode", lambda *a, **k: calls.append(1))
    kw = dict(kw)
    with pytest.raises(KVSimdError, match=pattern):
        m.generate(kw.pop("src", [5, 6, 7]), max_new_tokens=3, **kw)
    assert calls == []       # the encoder never ran


@pytest.mark.parametrize("kw, pattern", [(kw, p) for kw, p in BAD if set(kw) <= {"temperature", "top_k", "top_p"}]
                         + [(dict(rng=3), r"rng must be None or a numpy.random.Generator, got 3")])
def test_sample_uses_the_same_checks(kw, pattern):
    with pytest.raises(KVSimdError, match=pattern):
        sample(np.zeros(V), **kw) if "rng" not in kw else sample(np.zeros(V), kw["rng"])


@pytest.mark.parametrize("logits, pattern", [
    (np.array([0.5, np.nan, 1.0]), r"logits contain NaN or \+inf at 1 of 3 entries \(first ids \[1\]\)"),
    (np.array([0.5, np.inf, 1.0]), r"NaN or \+inf"),
    (np.full(4, -np.inf), r"logits are all -inf"),
    (np.zeros((2, 3)), r"logits must be a non-empty 1-D array, got shape \(2, 3\)"),
])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sample_refuses_logits_it_cannot_choose_from(logits, pattern, temperature):
    with pytest.raises(KVSimdError, match=pattern):
        sample(logits, np.random.default_rng(0), temperature=temperature)


def test_sample_with_masked_logits():
    z = np.array([-np.inf, 2.0, -np.inf, 1.0])
    assert sample(z) == 1
    assert {sample(z, np.random.default_rng(s), temperature=1.0) for s in range(40)} == {1, 3}


def test_nan_logits_stop_generation_with_an_error():
    dec = random_decoder(position="rope")
    greedy = list(dec.generate(PROMPT, max_new_tokens=6))
    dec.lm_head[:, greedy[2]] = np.nan          # in place: that token's logit is NaN from now on
    gen = dec.generate(PROMPT, max_new_tokens=6)
    with pytest.raises(KVSimdError, match=r"logits of sequence 0 at new token 0 contain NaN"):
        next(gen)


def test_stop_tokens_end_each_stream_and_are_not_yielded():
    dec = random_decoder(position="rope", seed=4)
    prompts = [[3, 14, 15], [9, 2, 6, 5, 35]]
    free = list(dec.generate(prompts, max_new_tokens=12, cache_dtype="float32"))
    assert len(free) == 12
    cols = [[row[b] for row in free] for b in range(2)]
    for stop in {cols[0][3], cols[1][5]}:
        firsts = [c.index(stop) if stop in c else None for c in cols]
        want = []
        for i in range(12):
            row = [cols[b][i] if firsts[b] is None or i < firsts[b] else None for b in range(2)]
            if all(v is None for v in row):
                break
            want.append(row)
        assert list(dec.generate(prompts, max_new_tokens=12, cache_dtype="float32", stop_tokens=[stop])) == want
        for b in range(2):
            alone = list(dec.generate(prompts[b], max_new_tokens=12, cache_dtype="float32", stop_tokens=[stop]))
            assert alone == cols[b][:firsts[b]] and stop not in alone


def test_fixed_cache_full_before_max_new_tokens_raises_after_the_tokens_that_fit():
    dec = random_decoder(position="rope")
    greedy = list(dec.generate(PROMPT, max_new_tokens=20, cache_dtype="float32"))
    got = []
    with pytest.raises(KVSimdCapacityError, match=r"sequence 0 filled its cache \(capacity 10\) after 6 of "
                                                  r"max_new_tokens=20"):
        for t in dec.generate(PROMPT, max_new_tokens=20, capacity=10, cache_dtype="float32"):
            got.append(t)
    # 10 slots: the prompt's 5 and 5 generated tokens fed back; the 6th is yielded but never fed
    assert got == greedy[:6]
    # a batch: the sequence that fills is named; a finished one does not count
    prompts = [PROMPT, PROMPT[:2]]
    with pytest.raises(KVSimdCapacityError, match=r"sequence 0 filled its cache \(capacity 10\)"):
        list(dec.generate(prompts, max_new_tokens=20, capacity=10))
    stop = greedy[2]
    assert list(dec.generate(prompts[:1] * 2, max_new_tokens=20, capacity=10, stop_tokens=[stop])) == \
        [[t, t] for t in greedy[:greedy.index(stop)]]
    # a finished sequence may fill its cache while another goes on: only the live one is named
    short = [7, 8]
    alone = list(dec.generate(short, max_new_tokens=20, cache_dtype="float32"))
    assert greedy[0] not in alone[:9]
    got = []
    with pytest.raises(KVSimdCapacityError, match=r"sequence 1 filled its cache \(capacity 10\) after 9 of"):
        for row in dec.generate([PROMPT, short], max_new_tokens=20, capacity=10, cache_dtype="float32",
                                stop_tokens=[greedy[0]]):
            got.append(row)
    assert got == [[None, t] for t in alone[:9]]


def test_max_new_tokens_zero_yields_nothing_and_runs_nothing(spied):
    dec, calls = spied
    assert list(dec.generate(PROMPT, max_new_tokens=0)) == []
    assert calls == []
