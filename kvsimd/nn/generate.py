"""Token ids in, token ids out: the checks of prompts and sampling parameters, sampling, and the
generate loop every model shares (Decoder.generate, EncoderDecoder.generate)."""
from __future__ import annotations

import math

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdCapacityError, KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import _real
from kvsimd.observe import notify

_need_int = _kvsimd._need_int

__all__ = ["sample"]

MAX_LOOKUP = 256        # drafted tokens per prompt-lookup pass, at most
LOOKUP_NGRAM = 3        # longest suffix prompt lookup matches
LOOKUP_BACKOFF = 16     # most tokens decoded one at a time after passes whose drafts all failed


def _short(x, n=80):
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def _tokens_1d(tokens, vocab, what="tokens"):
    """``tokens`` as a non-empty int64 array of ids in 0..vocab-1; KVSimdError naming ``what`` otherwise."""
    try:
        n = len(tokens)
    except TypeError:
        n = 0
    if n > _kvsimd.MAX_TOKENS:
        raise KVSimdValueError("%s has %d ids, more than the %d tokens a cache can hold" % (what, n, _kvsimd.MAX_TOKENS))
    try:
        t = np.asarray(tokens) if not isinstance(tokens, (str, bytes)) else None
    except (TypeError, ValueError):      # ragged nesting, objects NumPy cannot hold
        t = None
    if t is None or t.dtype == object or t.ndim != 1 or t.size == 0:
        raise KVSimdValueError("%s must be a non-empty 1-D sequence of integer token ids, got %s"
                               % (what, _short(tokens)))
    if t.dtype.kind not in "iu":   # (np.issubdtype counts timedelta64 as an integer)
        raise KVSimdTypeError("%s must be integer token ids, got dtype %s: %s" % (what, t.dtype, _short(tokens)))
    if t.min() < 0 or t.max() >= vocab:
        raise KVSimdValueError("%s contain ids outside the vocabulary 0..%d: %s"
                               % (what, vocab - 1, t[(t < 0) | (t >= vocab)][:5].tolist()))
    return t.astype(np.int64)


def _prompts(prompt, vocab, what):
    """A prompt (ids) or a batch (a list of id lists, or a 2-D array) -> (list of id lists, batched)."""
    if isinstance(prompt, np.ndarray):
        batched = prompt.ndim == 2
    elif isinstance(prompt, (list, tuple, range)):
        if len(prompt) == 0:
            raise KVSimdValueError("%s must not be empty" % what)
        nested = [isinstance(p, (list, tuple, range, np.ndarray)) for p in prompt]
        if any(nested) and not all(nested):
            raise KVSimdValueError("%s mixes token ids and lists of token ids: %s" % (what, _short(prompt)))
        batched = nested[0]
    else:
        raise KVSimdTypeError("%s must be a list of token ids or a list of such lists, got %s"
                              % (what, _short(prompt)))
    if batched and len(prompt) == 0:
        raise KVSimdValueError("%s is an empty batch: it needs at least one sequence" % what)
    if batched:
        return [_tokens_1d(p, vocab, "%s[%d]" % (what, b)).tolist() for b, p in enumerate(prompt)], True
    return [_tokens_1d(prompt, vocab, what).tolist()], False


def _sampling_params(temperature, top_k, top_p):
    """The one check of sampling parameters (sample() and every generate())."""
    temperature = _real(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise KVSimdValueError("temperature must be finite and >= 0 (0: greedy), got %r" % temperature)
    top_k = _need_int(top_k, "top_k")
    if top_k < 0:
        raise KVSimdValueError("top_k must be >= 0 (0: no top-k truncation), got %d" % top_k)
    top_p = _real(top_p, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise KVSimdValueError("top_p must be in (0, 1] (1: no nucleus truncation), got %r" % top_p)
    return temperature, top_k, top_p


def _sample(logits, rng, temperature, top_k, top_p, what="logits"):
    """sample() on checked parameters; refuses NaN / +inf logits instead of picking token 0 forever."""
    try:
        z = np.asarray(logits)
    except (TypeError, ValueError):
        z = np.asarray(None)
    if z.dtype.kind not in "iuf":   # real numbers: not bool, timedelta64 (an "integer" to np.issubdtype), ...
        raise KVSimdTypeError("%s must be an array of real numbers, got %s" % (what, _short(logits)))
    z = z.astype(np.float64)
    if z.ndim != 1 or z.size == 0:
        raise KVSimdValueError("%s must be a non-empty 1-D array, got shape %s" % (what, z.shape))
    if temperature == 0:
        best = int(np.argmax(z))    # NaN counts as the maximum: one pass checks and picks
        top = z[best]
    else:
        top = z.max()
    if not top < np.inf:
        bad = np.nonzero(np.isnan(z) | np.isposinf(z))[0]
        raise KVSimdValueError("%s contain NaN or +inf at %d of %d entries (first ids %s): the model's numbers "
                               "overflowed" % (what, bad.size, z.size, bad[:5].tolist()))
    if top == -np.inf:
        raise KVSimdValueError("%s are all -inf: no token can be chosen" % what)
    if temperature == 0:
        return best
    with np.errstate(over="ignore"):
        z = (z - top) / temperature      # <= 0 and finite or -inf, even for a tiny temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    z = z[order] - z[order[0]]
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        keep = np.searchsorted(np.cumsum(p), top_p) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(order[rng.choice(len(order), p=p)])


def sample(logits, rng=None, *, temperature=0.0, top_k=0, top_p=1.0):
    """Pick a token from ``logits [vocab]``: greedy when temperature is 0, else seeded sampling
    with optional top-k (0: off) and nucleus top-p (1: off) truncation.  ``temperature`` must be
    finite and >= 0, ``top_k`` an integer >= 0, ``top_p`` in (0, 1], ``rng`` None or a
    ``numpy.random.Generator``; NaN or +inf logits raise :class:`kvsimd.KVSimdValueError`."""
    params = _sampling_params(temperature, top_k, top_p)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise KVSimdTypeError("rng must be None or a numpy.random.Generator, got %s" % _short(rng))
    return _sample(logits, rng, *params)


def _generate(model, prompts, batched, sources, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
              cache_dtype, capacity, streaming=None, lookup=None):
    """Check every argument and make the cache now; return the token stream (which prefills at
    its first next())."""
    params = _sampling_params(temperature, top_k, top_p)
    lookup = 0 if lookup is None else _need_int(lookup, "lookup")
    if not 0 <= lookup <= MAX_LOOKUP:
        raise KVSimdValueError("lookup must be None or an integer in 0..%d (tokens drafted per step; 0: off), got %d"
                               % (MAX_LOOKUP, lookup))
    if lookup and params[0] != 0:
        raise KVSimdValueError("lookup=%d verifies drafts against greedy choices: it needs temperature=0, got %r"
                               % (lookup, params[0]))
    if lookup and (batched or sources is not None):
        raise KVSimdValueError("lookup=%d decodes a single prompt of a decoder-only model, got %s"
                               % (lookup, "a batch of %d prompts" % len(prompts) if batched else "a source"))
    max_new_tokens = _need_int(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 0:
        raise KVSimdValueError("max_new_tokens must be >= 0, got %d" % max_new_tokens)
    if seed is not None and (_need_int(seed, "seed") < 0):
        raise KVSimdValueError("seed must be None or an integer >= 0, got %d" % seed)
    if stop_tokens is None:
        stop_tokens = ()
    if not isinstance(stop_tokens, (list, tuple, set, frozenset, range, np.ndarray)) or \
            (isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim != 1):
        raise KVSimdTypeError("stop_tokens must be a list of token ids, got %s" % _short(stop_tokens))
    if len(stop_tokens) > model.cfg.vocab_size:
        raise KVSimdValueError("stop_tokens has %d ids, more than the vocabulary's %d"
                               % (len(stop_tokens), model.cfg.vocab_size))
    stop_tokens = list(stop_tokens)
    stop = set(_tokens_1d(stop_tokens, model.cfg.vocab_size, "stop_tokens").tolist()) if stop_tokens else set()
    longest = max(len(p) for p in prompts)
    if capacity is None:
        capacity = longest + max_new_tokens
    elif _need_int(capacity, "capacity") < longest:
        b = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise KVSimdCapacityError("capacity=%d is smaller than prompt %d (%d tokens)" % (capacity, b, longest))
    cache = model.new_cache(batch=len(prompts), capacity=capacity, dtype=cache_dtype, **(streaming or {}))
    # the last position any token will take: the cache never holds more than capacity tokens, and
    # the last generated token is never fed back
    model._check_position(min(cache.capacity, longest + max(max_new_tokens, 1) - 1) - 1)
    if sources is not None:
        for b, src in enumerate(sources):
            model._check_source(len(src), "src[%d]" % b if batched else "src")
    rng = np.random.default_rng(seed)
    if lookup:
        return _lookup_stream(model, prompts[0], cache, max_new_tokens, lookup, stop)
    return _stream(model, prompts, batched, sources, cache, cache_dtype, max_new_tokens, params, rng, stop)


def _full_error(b, cache, n_new, max_new_tokens):
    return KVSimdCapacityError("generate: sequence %d filled its cache (capacity %d) after %d of max_new_tokens=%d "
                               "new tokens; pass a larger capacity, or a streaming policy"
                               % (b, cache.capacity, n_new, max_new_tokens))


def _stream(model, prompts, batched, sources, cache, cache_dtype, max_new_tokens, params, rng, stop):
    if max_new_tokens == 0:
        return
    B = len(prompts)
    cross = model.cross_for(sources, cache_dtype) if sources is not None else None
    logits = np.stack([model._prefill_logits(p, cache, b, cross) for b, p in enumerate(prompts)])
    done = [False] * B
    last = [p[-1] for p in prompts]
    for i in range(max_new_tokens):
        for b in range(B):
            if not done[b]:
                tok = _sample(logits[b], rng, *params, what="logits of sequence %d at new token %d" % (b, i))
                done[b] = tok in stop          # a stop token ends the sequence: it is not yielded
                last[b] = tok
        if all(done):
            return
        out = [None if done[b] else last[b] for b in range(B)]
        yield out if batched else out[0]
        if i + 1 == max_new_tokens:
            return
        if cache.policy == "fixed":
            lengths = cache.lengths
            for b in range(B):
                if lengths[b] == cache.capacity:
                    if not done[b]:
                        raise _full_error(b, cache, i + 1, max_new_tokens)
                    cache._forget(b, 1)    # a finished sequence's cache is never read again
        logits = model._step_logits(last, cache, cross)


def _draft(history, n, longest=LOOKUP_NGRAM):
    """Prompt lookup: ``n`` tokens continuing ``history`` as it went on after the latest earlier
    occurrence of its longest suffix (``longest``..1 tokens); [] when no suffix occurs earlier.
    A match ``p`` tokens back predicts ``h[t] = h[t - p]``, also over the drafted tokens (so a
    period shorter than ``n`` still drafts ``n``)."""
    h = np.asarray(history, dtype=np.int64)
    N = h.size
    for k in range(min(longest, N - 1), 0, -1):
        # windows starting at 0..N-1-k: each is followed by a token, the suffix itself is not among them
        hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(h[:N - 1], k) == h[N - k:]).all(axis=1))
        if hits.size:
            p = N - k - int(hits[-1])
            run = h[N - p:].tolist()
            return (run * (n // p + 1))[:n]
    return []


def _lookup_stream(model, prompt, cache, max_new_tokens, n, stop):
    """Greedy decoding of one sequence with prompt-lookup drafts (generate(..., lookup=n)).

    Each pass feeds the current token and up to ``n`` drafts (see _draft) as one causal
    multi-row pass after the cached prefix (a prefill plan), keeps the drafts that match the
    greedy choice of the row before them and truncates the others from the cache; the row after
    the last kept draft gives the next token.  The pass and the truncate are one transaction.
    A pass needs a ring that has not wrapped and room for its rows: once a streaming window is
    full (or has wrapped) and under "fixed" at the end of the cache, tokens go one step at a
    time, as without lookup.  Drafts beyond what ``max_new_tokens`` can still yield are not made.
    A pass that keeps no draft costs more than a step and gains nothing: after one, the next
    ``pause`` tokens are plain steps, ``pause`` doubling with each such pass in a row (1, 2, 4, ..
    LOOKUP_BACKOFF) and back to 0 once a draft is kept, so text that does not repeat decodes at
    about the speed of plain steps."""
    if max_new_tokens == 0:
        return
    greedy = (0.0, 0, 1.0)
    history = list(prompt)
    cur = _sample(model._prefill_logits(prompt, cache, 0, None), None, *greedy, what="logits at new token 0")
    i = 0                                   # tokens yielded
    nk, C = cache.n_keep, cache.capacity
    pause = wait = 0                        # back-off after passes that kept nothing (see above)
    while True:
        if cur in stop:
            return
        yield cur
        i += 1
        history.append(cur)
        if i == max_new_tokens:
            return
        L = cache.length(0)
        room = min(n, max_new_tokens - i - 1, C - L - 1)
        if wait:
            wait -= 1
            drafts = []
        elif room > 0 and cache.head[0] == nk and cache.seen[0] == L:
            drafts = _draft(history, room)
        else:
            drafts = []
        if not drafts:
            if cache.policy == "fixed" and L == C:
                raise _full_error(0, cache, i, max_new_tokens)
            cur = _sample(model._step_logits([cur], cache, None)[0], None, *greedy,
                          what="logits at new token %d" % i)
            continue
        d = len(drafts)
        with cache.transaction():
            rows = model._prefill(np.array([cur] + drafts, dtype=np.int64), cache, 0, None, finish=model._logits)
            a = 0
            best = _sample(rows[0], None, *greedy, what="logits at new token %d" % i)
            while a < d and drafts[a] == best:
                a += 1
                best = _sample(rows[a], None, *greedy, what="logits at new token %d" % (i + a))
            cache.truncate(0, d - a)
        notify(model, "drafts", d, a)
        pause = 0 if a else min(max(1, 2 * pause), LOOKUP_BACKOFF)
        wait = pause
        for t in drafts[:a]:                # a <= max_new_tokens - i - 1: all of them may be yielded
            if t in stop:
                return
            yield t
            i += 1
            history.append(t)
        cur = best
