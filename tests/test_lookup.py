"""Prompt-lookup decoding, generate(..., lookup=n): the tokens are plain greedy decoding's
(transformers' greedy loop on the same tiny random models, and kvsimd's own plain loop), drafts are
actually accepted on repetitive text, stop tokens and max_new_tokens hold, streaming policies fall
back to single steps once their window is full, and bad arguments are refused."""
import numpy as np
import pytest

from kvsimd import KVSimdCapacityError, KVSimdTypeError, KVSimdValueError
import kvsimd.nn.generate as generate_module
from kvsimd.nn.generate import _draft
from kvsimd.observe import Observer, observe

from test_models import V, causal, torch
from test_streaming import random_decoder


class Drafts(Observer):
    def __init__(self):
        self.proposed = self.accepted = self.passes = 0

    def drafts(self, proposed, accepted):
        self.passes += 1
        self.proposed += proposed
        self.accepted += accepted


def hf_greedy(m, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def repetitive(rng, period=9, reps=4):
    unit = list(rng.integers(0, V, period))
    return unit * reps + unit[:3]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom", "gemma2", "qwen2-window"])
def test_tokens_are_greedy_decodings_and_drafts_are_accepted(name, rng):
    m, d = causal(name)
    for prompt in (repetitive(rng), list(rng.integers(0, V, 11))):
        want = hf_greedy(m, prompt, 40)
        assert list(d.generate(prompt, max_new_tokens=40, cache_dtype="float32")) == want
        with observe(d, Drafts()) as o:
            got = list(d.generate(prompt, max_new_tokens=40, cache_dtype="float32", lookup=4))
        assert got == want, name
        assert o.passes > 0 and o.accepted <= o.proposed
    # the repetitive prompt echoes: drafts were accepted, fewer passes than tokens
    prompt = repetitive(rng)
    with observe(d, Drafts()) as o:
        got = list(d.generate(prompt, max_new_tokens=40, lookup=4))
    assert got == list(d.generate(prompt, max_new_tokens=40))
    assert o.accepted > 0, (name, o.proposed)


def test_acceptance_on_text_the_model_repeats():
    """A model whose greedy output cycles: most drafts are accepted, and the stream needs far fewer
    passes than tokens (passes counted by the observer's positions events)."""
    class Passes(Drafts):
        def __init__(self):
            super().__init__()
            self.forward = 0

        def positions(self, part, n):
            self.forward += 1

    d = random_decoder(n_layers=2, seed=2)
    for lw in d.layers:           # attention output scaled down: the greedy output soon cycles
        lw.attn.wo = lw.attn.wo * 0.1
    prompt = list(np.random.default_rng(0).integers(0, 53, 6))
    plain = list(d.generate(prompt, max_new_tokens=80, cache_dtype="float32"))
    assert len(set(plain[40:])) <= 3, plain
    with observe(d, Passes()) as o:
        got = list(d.generate(prompt, max_new_tokens=80, cache_dtype="float32", lookup=6))
    assert got == plain
    assert o.accepted >= 0.5 * o.proposed and o.accepted >= 40, (o.accepted, o.proposed)
    assert o.forward <= 80 - 40          # one prefill, then one pass per step or verified draft run


def test_stop_tokens_and_max_new_tokens(rng):
    _, d = causal("llama")
    prompt = repetitive(rng)
    plain = list(d.generate(prompt, max_new_tokens=60, cache_dtype="float32"))
    for n in (1, 2, 3, 5, 17, 60):
        for lookup in (1, 3, 8):
            got = list(d.generate(prompt, max_new_tokens=n, cache_dtype="float32", lookup=lookup))
            assert got == plain[:n], (n, lookup)
    # a stop token inside the accepted drafts or as the pass's own token: not yielded, the stream ends
    for i in (1, 5, 20, 33):
        stop = plain[i]
        first = plain.index(stop)
        for lookup in (2, 5):
            got = list(d.generate(prompt, max_new_tokens=60, cache_dtype="float32", lookup=lookup,
                                  stop_tokens=[stop]))
            assert got == plain[:first], (i, lookup)
    assert list(d.generate(prompt, max_new_tokens=0, lookup=3)) == []


@pytest.mark.parametrize("policy", ["shift", "sink_query", "reevaluate"])
def test_streaming_policies_fall_back_to_steps_when_the_window_is_full(policy):
    d = random_decoder(n_layers=2, seed=3)
    prompt = list(np.random.default_rng(0).integers(0, 53, 6))
    kw = dict(max_new_tokens=90, cache_dtype="float32", capacity=32, n_keep=4, policy=policy)
    plain = list(d.generate(prompt, **kw))
    with observe(d, Drafts()) as o:
        got = list(d.generate(prompt, lookup=5, **kw))
    assert got == plain
    assert o.passes > 0     # multi-row passes before the window filled (drafts kept or not)


@pytest.mark.parametrize("right", [False, True])
def test_back_off_after_passes_that_keep_nothing(monkeypatch, right):
    """Drafts that always fail (the greedy token + 1): after each such pass the next 1, 2, 4, 8,
    16, 16, .. tokens are plain steps, so 60 tokens take 7 passes, not 59; drafts that are always
    right (plain greedy's own continuation) never pause.  The tokens are plain greedy's either way."""
    d = random_decoder(n_layers=2, seed=5)
    prompt = [3, 1, 4, 1, 5]
    plain = list(d.generate(prompt, max_new_tokens=60, cache_dtype="float32"))

    def draft(history, n, longest=3):
        i = len(history) - len(prompt)            # tokens generated so far
        good = plain[i:i + n]
        return good if right else [(good[0] + 1) % d.cfg.vocab_size] * len(good)
    monkeypatch.setattr(generate_module, "_draft", draft)
    with observe(d, Drafts()) as o:
        got = list(d.generate(prompt, max_new_tokens=60, cache_dtype="float32", lookup=4))
    assert got == plain
    if right:
        assert o.accepted == o.proposed and o.passes == 12     # 1 + 4 drafts a pass; the last ones fewer
    else:
        assert o.accepted == 0 and o.passes == 7


def test_fixed_cache_full_is_the_same_error_after_the_same_tokens(rng):
    _, d = causal("llama")
    prompt = repetitive(rng)
    out = {}
    for lookup in (None, 4):
        got = []
        with pytest.raises(KVSimdCapacityError, match="filled its cache") as e:
            for t in d.generate(prompt, max_new_tokens=30, cache_dtype="float32", capacity=len(prompt) + 12,
                                lookup=lookup):
                got.append(t)
        out[lookup] = (got, str(e.value))
    assert out[None] == out[4] and len(out[4][0]) == 13


def test_bad_arguments_are_refused_naming_them():
    _, d = causal("llama")
    for bad, err, pat in [(-1, KVSimdValueError, r"lookup must be None or an integer in 0\.\.256.*got -1"),
                          (257, KVSimdValueError, "got 257"), ("3", KVSimdTypeError, "lookup"),
                          (1.5, KVSimdTypeError, "lookup"), (True, KVSimdTypeError, "lookup")]:
        with pytest.raises(err, match=pat):
            d.generate([1, 2, 3], lookup=bad)
    with pytest.raises(KVSimdValueError, match=r"lookup=2 .*temperature=0, got 0\.7"):
        d.generate([1, 2, 3], lookup=2, temperature=0.7)
    with pytest.raises(KVSimdValueError, match="lookup=2 decodes a single prompt.*a batch of 2 prompts"):
        d.generate([[1, 2, 3], [4, 5]], lookup=2)
    for off in (None, 0):       # off: sampling and batches as usual
        assert len(list(d.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, lookup=off))) == 3
        assert len(list(d.generate([1, 2], max_new_tokens=3, temperature=0.5, seed=1, lookup=off))) == 3


def brute_draft(h, n, longest=3):
    for k in range(min(longest, len(h) - 1), 0, -1):
        for i in range(len(h) - k - 1, -1, -1):      # latest earlier occurrence first
            if h[i:i + k] == h[len(h) - k:]:
                ext = list(h)                         # what followed it, then what follows that
                for _ in range(n):
                    ext.append(ext[len(ext) - (len(h) - k - i)])
                return ext[len(h):]
    return []


def test_draft_is_the_continuation_of_the_latest_longest_match():
    rng = np.random.default_rng(4)
    for _ in range(400):
        h = list(map(int, rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 30)))))
        n = int(rng.integers(1, 6))
        assert _draft(h, n) == brute_draft(h, n), (h, n)
    assert _draft([5, 1, 2, 3, 9, 9, 1, 2, 3], 4) == [9, 9, 1, 2]
    assert _draft([4, 4, 4], 3) == [4, 4, 4] and _draft([1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    assert _draft([1, 2, 3, 4], 2) == [] and _draft([7], 3) == []


@pytest.mark.parametrize("R,lookup", [(2, 2), (3, 3), (8, 4), (8, 8)])
def test_recent_float_rows_survive_rejected_drafts(rng, R, lookup):
    """An int4 cache with float rows of the last R tokens (cache_recent=R): a verify pass commits
    its drafts and the rejected ones are truncated, which takes their float rows with them; the
    ring keeps 2R committed rows, so the accepted tokens still read their last R keys as float
    rows and the tokens are plain greedy decoding's on the same cache (a ring of R rows left
    fewer: the tokens parted on 4 of 12 prompts at R = 2)."""
    m, d = causal("llama")
    kw = dict(max_new_tokens=30, cache_dtype="int4", cache_recent=R)
    parted = 0
    for _ in range(6):
        base = list(rng.integers(0, V, 5))
        for prompt in (base * 2 + base[:3], list(rng.integers(0, V, 9))):
            with observe(d, Drafts()) as o:
                got = list(d.generate(prompt, lookup=lookup, **kw))
            assert got == list(d.generate(prompt, **kw)), (R, lookup, prompt)
            parted += o.accepted < o.proposed
    assert parted > 0          # drafts were rejected, so the truncate ran
