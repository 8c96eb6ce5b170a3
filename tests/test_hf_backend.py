"""kvsimd inside transformers (kvsimd.integrations.transformers): the attention backend and the
caches against transformers' own attention (SDPA) and DynamicCache on tiny random Llama, Qwen2 and
Mistral models and on the real SmolLM2 loaded by transformers from its GGUF; the int8 and int4
caches against the family's own eager attention over the K/V values such a cache stores
(kvsimd.reference's NumPy rule); the sink cache against kvsimd's own Decoder under the same
policy, and its memory over 100,000 tokens.

Bounds: logits relative to the largest |logit| of the same step, kvsimd.testing.REFERENCE_BOUNDS
by cache dtype (float32 storage: rounding only; float16: K/V rounded once; int8 / int4 against
the reference that quantizes the same way: room for a step that float32 rounding flips)."""
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")
kt = pytest.importorskip("kvsimd.integrations.transformers")

from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

from kvsimd import Decoder, KVSimdCapacityError, KVSimdError, KVSimdTypeError, KVSimdValueError, reference  # noqa: E402
from kvsimd.testing import REFERENCE_BOUNDS  # noqa: E402

T.logging.set_verbosity_error()
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=4096)
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_key_value_heads=1)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-window": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=7)),
    # soft-capped scores, sliding-window layers alternating with full ones (transformers: eager only)
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(num_key_value_heads=2, head_dim=16, sliding_window=6,
                                                        attn_logit_softcapping=5.0, pad_token_id=0)),
}
STOCK = {"gemma2": "eager"}
#: (dtype, hadamard) of the quantized caches: int4 turned by the Hadamard matrix by default, int8 not
KINDS = [("int4", True), ("int4", False), ("int8", False), ("int8", True), ("int8/int4", True)]
#: heads of 48 dims for the quantized caches: a block of 32 (turned by H) and a shorter one (never turned)
WIDE = dict(head_dim=48)


def tiny(family, seed=0, attn="sdpa", **config):
    """The family's tiny random model (``config``: other settings of its config)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    m = model_cls(cfg_cls(**{**SMALL, **extra, **config}, attn_implementation=attn)).eval()
    with torch.no_grad():         # larger weights than the default init: peaked, decisive logits
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return m


def run(m, ids, attn, cache=None, **kw):
    """(tokens, per-step logits [steps, B, vocab]) of a generate call under ``attn``."""
    m.set_attn_implementation(attn)
    torch.manual_seed(123)
    kw.setdefault("do_sample", False)
    out = m.generate(ids, max_new_tokens=kw.pop("n", 24), past_key_values=cache, output_logits=True,
                     return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits).numpy()


def stored_eager(kind):
    """The name of a transformers attention implementation (registered here): the module's own
    eager attention (its family's ``eager_attention_forward``: scaling, soft cap, masks) over K/V
    read as a kvsimd cache of ``kind`` = (dtype, hadamard) stores them -- each row quantized by
    kvsimd.reference's NumPy rule (turned by H first when ``hadamard``), the values it stands for
    (turned back), in float64 then float32, and over int8 or int4 keys the query rounded by the int8 rule
    (reference.query_as_read, as kvsimd's attention reads it).  DynamicCache keeps the float K/V:
    every call quantizes the rows again, the same rows the same way."""
    name = "stored-%s-%s" % (kind[0].replace("/", "-"), "turned" if kind[1] else "plain")

    def attn(module, query, key, value, attention_mask, **kw):
        k, v = (torch.from_numpy(reference._as_cached(kind, t.detach().float().numpy(), t.shape[-1], which)
                                 .astype(np.float32)) for which, t in enumerate((key, value)))
        query = torch.from_numpy(np.asarray(reference.query_as_read(query.detach().float().numpy(), kind), np.float32))
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, k, v, attention_mask, **kw)

    T.AttentionInterface.register(name, attn)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def stored_recent(kind, R):
    """A transformers attention implementation (registered here): float64 attention over K/V read
    as a kvsimd cache of ``kind`` with ``recent=R`` float rows reads them -- row t (at slot
    N - T + t) reads key j from its float16 row (turned by H first when ``kind`` turns, as the
    cache stores it) when j > N - T + t - R, else as quantized (kvsimd.reference's rule, with the
    query that rule rounds); the keys the family's eager mask lets the row see (causal, padding,
    sliding window).  Independent of kvsimd's kernels and bookkeeping."""
    name = "stored-recent-%s-%s-%d" % (kind[0].replace("/", "-"), "turned" if kind[1] else "plain", R)
    had = kind[1]

    def as_float16(x):
        if not had:
            return x.astype(np.float16).astype(np.float64)
        t = reference.hadamard_rows(x.astype(np.float32), _back=False).astype(np.float16).astype(np.float32)
        return reference.hadamard_rows(t).astype(np.float64)

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        q = query.detach().float().numpy().astype(np.float64)
        k, v = (t.detach().float().numpy() for t in (key, value))
        B, H, T, D = q.shape
        N, G = k.shape[2], H // k.shape[1]
        kq, vq = (reference._as_cached(kind, x, D, which).astype(np.float64) for which, x in enumerate((k, v)))
        kf, vf = as_float16(k), as_float16(v)
        qr = np.asarray(reference.query_as_read(q.astype(np.float32), kind), np.float64)
        m = attention_mask.detach().numpy()
        see = m if m.dtype == bool else (m == 0)
        out = np.zeros((B, T, H, D))
        for b in range(B):
            for t in range(T):
                pos = N - T + t
                vis = see[b, 0, t, :N]
                fl = np.arange(N) > pos - R
                for h in range(H):
                    g = h // G
                    sc = np.where(fl, kf[b, g] @ q[b, h, t], kq[b, g] @ qr[b, h, t]) * scaling
                    sc = np.where(vis, sc, -np.inf)
                    if not vis.any():
                        continue
                    w = np.exp(sc - sc.max())
                    val = np.where(fl[:, None], vf[b, g], vq[b, g])
                    out[b, t, h] = (w @ val) / w.sum()
        return torch.from_numpy(out.astype(np.float32)), None

    T.AttentionInterface.register(name, attn)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt(seed, B=1, n=11):
    return torch.randint(1, 97, (B, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_dynamic_cache(family):
    m = tiny(family, attn=STOCK.get(family, "sdpa"))
    ids = prompt(1, n=14)
    ref_tok, ref_log = run(m, ids, STOCK.get(family, "sdpa"))
    for dtype in ("float32", "float16"):
        tok, log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype=dtype))
        assert torch.equal(tok, ref_tok), (family, dtype)
        assert rel(log, ref_log) <= REFERENCE_BOUNDS[dtype], (family, dtype, rel(log, ref_log))
    # int8 and int4 storage: the tokens and logits of kvsimd's own Decoder with the same weights on
    # such a cache (the same quantization rule and kernels, int4 turned by H; K/V differ by float32
    # rounding only)
    dec = Decoder.from_transformers(m)
    for dtype in ("int8", "int4"):
        tok, log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype=dtype))
        mine = list(dec.generate(ids[0].tolist(), max_new_tokens=24, cache_dtype=dtype))
        assert tok[0, ids.shape[1]:].tolist() == mine, (family, dtype)
        cq = dec.new_cache(capacity=64, dtype=dtype)
        want = [dec.prefill(ids[0].tolist(), cache=cq)] + [dec.step([t], cache=cq)[0] for t in mine[:-1]]
        err = rel(log[:, 0], np.array(want))
        assert err <= REFERENCE_BOUNDS[dtype], (family, dtype, err)
    # the backend over transformers' own DynamicCache (tensors handed in, no kvsimd cache)
    tok, log = run(m, ids, kt.NAME)
    assert torch.equal(tok, ref_tok) and rel(log, ref_log) <= REFERENCE_BOUNDS["float32"]


@pytest.mark.parametrize("kind", KINDS, ids=["int4", "int4-plain", "int8", "int8-turned", "int8-int4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_cache_matches_eager_attention_over_its_values(family, kind):
    """A quantized KVSimdCache gives the greedy tokens of the model under its family's eager
    attention over the K/V values such a cache stores (stored_eager: kvsimd.reference, no kvsimd
    kernel), and its logits within REFERENCE_BOUNDS: the prompt through ops.attend (several rows),
    decode steps through the cache's own call or, with a sliding window, ops.attend over ranges."""
    dtype, had = kind
    m = tiny(family, attn=STOCK.get(family, "sdpa"), **WIDE)
    ids = prompt(1, n=14)
    ref_tok, ref_log = run(m, ids, stored_eager(kind))
    cache = kt.KVSimdCache(m, dtype=dtype, hadamard=had)
    tok, log = run(m, ids, kt.NAME, cache)
    assert cache.kv.kv_dtype == dtype and cache.kv.hadamard == had == cache.hadamard
    assert torch.equal(tok, ref_tok), (family, kind)
    assert rel(log, ref_log) <= REFERENCE_BOUNDS[dtype], (family, kind, rel(log, ref_log))


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_int4_cache_padded_batch(family):
    """A left-padded batch on the int4 cache: decode steps through ops.attend over each sequence's
    ranges (turned query and output), against the eager attention over the stored values."""
    m = tiny(family, seed=3, **WIDE)
    ids = prompt(2, B=3, n=12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :9] = 0
    ids = ids * mask
    ref_tok, ref_log = run(m, ids, stored_eager(("int4", True)), attention_mask=mask)
    tok, log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="int4"), attention_mask=mask)
    assert torch.equal(tok, ref_tok)
    assert rel(log, ref_log) <= REFERENCE_BOUNDS["int4"], rel(log, ref_log)


@pytest.mark.parametrize("kind,R", [(("int4", True), 4), (("int4", False), 1), (("int8", False), 3),
                                    (("int8/int4", True), 32)], ids=["int4-4", "int4-plain-1", "int8-3", "int8-int4-32"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window"])
def test_recent_rows_read_each_rows_last_keys_as_float(family, kind, R):
    """KVSimdCache(recent=R): the prompt (every row of it) and each decode step read a row's last
    R keys from float16 rows and older keys quantized -- the greedy tokens of float64 attention
    that reads K/V so (stored_recent), logits within REFERENCE_BOUNDS; the tokens and logits of
    kvsimd's own Decoder with the same weights and cache_recent=R (its compiled layers and plans,
    another path to the same rule); and farther from both without the float rows (int4 keys), so
    that a cache that did not read them fails."""
    dtype, had = kind
    m = tiny(family, attn=STOCK.get(family, "sdpa"), **WIDE)
    m.generation_config.eos_token_id = None     # the Decoder's generate does not stop at it either
    ids = prompt(1, n=14)
    ref_tok, ref_log = run(m, ids, stored_recent(kind, R))
    cache = kt.KVSimdCache(m, dtype=dtype, hadamard=had, recent=R)
    tok, log = run(m, ids, kt.NAME, cache)
    assert cache.kv.recent == R and cache.recent == R
    assert torch.equal(tok, ref_tok), (family, kind, R)
    err = rel(log, ref_log)
    assert err <= REFERENCE_BOUNDS[dtype], (family, kind, R, err)
    if family != "mistral-window" and had == ("int4" in dtype):   # generate's default turn; its windows:
        dec = Decoder.from_transformers(m)                          # tests/test_recent_rows.py
        mine = list(dec.generate(ids[0].tolist(), max_new_tokens=24, cache_dtype=dtype, cache_recent=R))
        assert tok[0, ids.shape[1]:].tolist() == mine, (family, kind, R)
        cq = dec.new_cache(capacity=64, dtype=dtype, recent=R, hadamard=had)
        want = np.array([dec.prefill(ids[0].tolist(), cache=cq)] + [dec.step([t], cache=cq)[0] for t in mine[:-1]])
        assert rel(log[:, 0], want) <= REFERENCE_BOUNDS[dtype], (family, kind, R, rel(log[:, 0], want))
    if dtype != "int8":
        _, plain = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype=dtype, hadamard=had))
        assert rel(plain, ref_log) > 4 * max(err, REFERENCE_BOUNDS[dtype] / 4), (family, kind, rel(plain, ref_log))


def test_recent_rows_above_the_first_capacity():
    """KVSimdCache(recent=32) starting at a capacity of 4: the KVCache caps its float rows at its
    capacity (every token has one), each growth carries them into the next (whose cap is larger),
    and the tokens are those of the Decoder with cache_recent=32."""
    m = tiny("llama", **WIDE)
    m.generation_config.eos_token_id = None
    ids = prompt(3, n=9)
    cache = kt.KVSimdCache(m, dtype="int4", recent=32, capacity=4)
    tok, _ = run(m, ids, kt.NAME, cache, n=40)
    mine = list(Decoder.from_transformers(m).generate(ids[0].tolist(), max_new_tokens=40, cache_dtype="int4",
                                                      cache_recent=32))
    assert tok[0, 9:].tolist() == mine
    assert cache.kv.recent == 32 and cache.kv.recent_rows(1)[0].shape[1] == 32


def test_recent_rows_padded_batch_and_growth():
    """A left-padded batch of 2 on KVSimdCache(dtype="int4", recent=6), starting at a capacity of 8
    so that it grows twice (the float rows move with the tokens): the greedy tokens of stored_recent
    and logits within the int4 bound."""
    m = tiny("llama", **WIDE)
    ids = prompt(5, B=2, n=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    ref_tok, ref_log = run(m, ids, stored_recent(("int4", True), 6), attention_mask=mask)
    cache = kt.KVSimdCache(m, dtype="int4", recent=6, capacity=8)
    tok, log = run(m, ids, kt.NAME, cache, attention_mask=mask)
    assert cache.kv.capacity >= 32
    assert torch.equal(tok, ref_tok)
    assert rel(log, ref_log) <= REFERENCE_BOUNDS["int4"], rel(log, ref_log)


def test_int4_cache_check_can_fail(monkeypatch):
    """The checks above can fail: with ops.attend not told that the rows are turned (the query and
    the output not turned), the int4 cache's tokens or logits leave the reference's bound."""
    m = tiny("llama", **WIDE)
    ids = prompt(1, n=14)
    ref_tok, ref_log = run(m, ids, stored_eager(("int4", True)))
    attend = kt.ops.attend
    monkeypatch.setattr(kt.ops, "attend", lambda *a, hadamard=False, **kw: attend(*a, **kw))
    tok, log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="int4"))
    assert not (torch.equal(tok, ref_tok) and rel(log, ref_log) <= REFERENCE_BOUNDS["int4"]), rel(log, ref_log)


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_padded_batch_and_sampling(family):
    m = tiny(family, seed=3)
    ids = prompt(2, B=3, n=12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0                      # left padding of different lengths
    mask[2, :9] = 0
    ids = ids * mask
    ref_tok, ref_log = run(m, ids, "sdpa", attention_mask=mask)
    tok, log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="float32"), attention_mask=mask)
    assert torch.equal(tok, ref_tok)
    assert rel(log, ref_log) <= REFERENCE_BOUNDS["float32"]
    ref_tok, _ = run(m, ids, "sdpa", attention_mask=mask, do_sample=True, top_k=20, temperature=0.9)
    tok, _ = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="float32"), attention_mask=mask, do_sample=True,
                 top_k=20, temperature=0.9)
    assert torch.equal(tok, ref_tok)


def test_prefill_logits_and_growth():
    """A 300-token prompt: multi-row attention in one call per sequence, and the cache grows past
    its first capacity (256) by doubling, keeping its contents."""
    m = tiny("llama", seed=5)
    ids = prompt(4, n=300)
    m.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = m(ids).logits.numpy()
    m.set_attn_implementation(kt.NAME)
    with torch.no_grad():
        got = m(ids).logits.numpy()
    assert rel(got, ref) <= REFERENCE_BOUNDS["float32"]
    cache = kt.KVSimdCache(m, dtype="float32", capacity=16)
    tok, log = run(m, ids[:, :10], kt.NAME, cache, n=40)
    ref_tok, ref_log = run(m, ids[:, :10], "sdpa", n=40)
    assert torch.equal(tok, ref_tok) and rel(log, ref_log) <= REFERENCE_BOUNDS["float32"]
    assert cache.kv.capacity >= 49 and cache.get_seq_length() == 49


def test_prompt_lookup_crops_the_cache():
    """transformers' prompt-lookup decoding verifies drafts in multi-token passes and crops the
    rejected ones: the same tokens as plain greedy decoding."""
    m = tiny("llama", seed=6)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    ref_tok, _ = run(m, ids, "sdpa", n=30)
    m.set_attn_implementation(kt.NAME)
    cache = kt.KVSimdCache(m, dtype="float32")
    tok = m.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=cache, prompt_lookup_num_tokens=4,
                     pad_token_id=0)
    assert torch.equal(tok, ref_tok)
    assert cache.get_seq_length() == tok.shape[1] - 1
    # int4 with float rows of the last R tokens: a crop drops the rejected tokens' rows and the
    # ring still holds R (it keeps 2R), so the tokens are plain greedy's on such a cache (a ring
    # that kept R parted from them on 2 of these 8 runs)
    m = tiny("llama", seed=2, **WIDE)
    m.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(2)
    for trial in range(4):
        base = torch.randint(1, 97, (1, 5), generator=g)
        ids = torch.cat([base, base, base[:, :3]], 1)
        for R in (2, 3):
            want, _ = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="int4", recent=R), n=30)
            tok = m.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=kt.KVSimdCache(
                m, dtype="int4", recent=R), prompt_lookup_num_tokens=R, pad_token_id=0)
            assert torch.equal(tok, want), (trial, R)


def test_crop_refuses_what_is_not_an_integer():
    """crop's count is checked as kvsimd checks integers: a string, None, NaN or a fraction is
    refused with a KVSimdError naming it (int() would have raised a bare error, or rounded -1.5
    and "-1" to a crop of one token), and the cache keeps its tokens."""
    m = tiny("llama", seed=6, attn=kt.NAME)
    for cache in (kt.KVSimdCache(m, dtype="float32"), kt.KVSimdSinkCache(m, window=16, n_keep=2)):
        m(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
        for bad in ("a", None, float("nan"), -1.5, "-1"):
            with pytest.raises(KVSimdError, match="tokens_to_remove"):
                cache.crop(bad)
        assert cache.get_seq_length() == 4
        cache.crop(-1)
        assert cache.get_seq_length() == 3


def test_sink_cache_equals_kvsimd_decoder_sink_query():
    """Past its window the sink cache gives the tokens kvsimd's own Decoder gives with the same
    weights under policy sink_query (prefill, then one token per step, the window sliding); heads
    of 48 dims, so that int4 rows are turned by H (the sink query too); with ``recent`` float rows
    as well."""
    m = tiny("llama", seed=7, **WIDE)
    dec = Decoder.from_transformers(m)
    ids = prompt(8, n=12)
    m.set_attn_implementation(kt.NAME)
    m.generation_config.eos_token_id = None     # the Decoder's generate does not stop at it either
    for dtype in ("float32", "float16", "int8", "int4", "int8/int4"):
        cache = kt.KVSimdSinkCache(m, window=20, n_keep=4, dtype=dtype)
        got = m.generate(ids, max_new_tokens=90, do_sample=False, past_key_values=cache, pad_token_id=0)
        mine = list(dec.generate(ids[0].tolist(), max_new_tokens=90, capacity=24, n_keep=4, policy="sink_query",
                                 cache_dtype=dtype))
        assert got[0, 12:].tolist() == mine, dtype
        assert cache.kv.length(0) == 24 and cache.get_seq_length() == 12 + 89
    # with recent float rows (R below and above the window): the Decoder's tokens with cache_recent=R,
    # which here differ from those without (so a sink cache that did not read them fails)
    for dtype, R in (("int4", 8), ("int4", 32), ("int8/int4", 1)):
        cache = kt.KVSimdSinkCache(m, window=20, n_keep=4, dtype=dtype, recent=R)
        got = m.generate(ids, max_new_tokens=90, do_sample=False, past_key_values=cache, pad_token_id=0)
        kw = dict(max_new_tokens=90, capacity=24, n_keep=4, policy="sink_query", cache_dtype=dtype)
        mine = list(dec.generate(ids[0].tolist(), cache_recent=R, **kw))
        assert mine != list(dec.generate(ids[0].tolist(), **kw)), (dtype, R)
        assert got[0, 12:].tolist() == mine, (dtype, R)
        assert cache.kv.recent == min(R, 24) and cache.kv.recent_rows(0)[0].shape[1] == min(R, 20)


def test_sink_cache_rotates_the_sink_query(monkeypatch):
    """The test above can fail: without the sink query's rotation (sinks read at the query's true
    distance) the tokens differ from the Decoder's."""
    m = tiny("llama", seed=7)
    dec = Decoder.from_transformers(m)
    ids = prompt(8, n=12)
    m.set_attn_implementation(kt.NAME)
    monkeypatch.setattr(kt.ops, "shift_keys", lambda *a, **k: None)
    got = m.generate(ids, max_new_tokens=90, do_sample=False, past_key_values=kt.KVSimdSinkCache(m, 20, 4, "float32"),
                     pad_token_id=0)
    mine = list(dec.generate(ids[0].tolist(), max_new_tokens=90, capacity=24, n_keep=4, policy="sink_query",
                             cache_dtype="float32"))
    assert got[0, 12:].tolist() != mine


def test_sink_cache_bounded_over_100k_tokens():
    """100,000 decode steps through the cache API (update + attention, as a layer calls them):
    the storage never grows and the process's memory stays flat (resident set, which a leak of
    a few bytes per step would move by megabytes)."""
    m = tiny("llama", seed=9)
    m.config.num_hidden_layers = 1
    m.set_attn_implementation(kt.NAME)
    cache = kt.KVSimdSinkCache(m, window=60, n_keep=4)
    mod = m.model.layers[0].self_attn
    rng = np.random.default_rng(0)
    kv = torch.from_numpy(rng.standard_normal((1, 2, 1, 16), dtype=np.float32))
    q = torch.from_numpy(rng.standard_normal((1, 4, 1, 16), dtype=np.float32))
    kf, vf = cache.update(torch.ones(1, 2, 8, 16), torch.ones(1, 2, 8, 16), 0)
    kt.attention(mod, torch.ones(1, 4, 8, 16), kf, vf, None)
    nbytes = cache.nbytes

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    for step in range(100_000):
        if step == 2000:
            base = rss()
        k, v = cache.update(kv, kv, 0)
        out, _ = kt.attention(mod, q, k, v, None)
    grown = rss() - base
    assert cache.get_seq_length() == 100_008 and cache.kv.length(0) == 64 and cache.nbytes == nbytes
    assert grown < 4 * 2 ** 20, grown
    assert np.isfinite(out.numpy()).all()


def test_refusals():
    m = tiny("llama")
    ids = prompt(1)
    m.set_attn_implementation("sdpa")
    with pytest.raises(KVSimdValueError, match="attn_implementation='kvsimd'"):
        m.generate(ids, max_new_tokens=2, past_key_values=kt.KVSimdCache(m))
    m.set_attn_implementation(kt.NAME)
    with pytest.raises(KVSimdValueError, match="beam search"):
        m.generate(ids, max_new_tokens=3, num_beams=2, past_key_values=kt.KVSimdCache(m), pad_token_id=0)
    with pytest.raises(KVSimdCapacityError, match="does not fit"):
        m.generate(prompt(1, n=30), max_new_tokens=2, past_key_values=kt.KVSimdSinkCache(m, 20, 4))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(KVSimdValueError, match="unpadded"):
        m.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=kt.KVSimdSinkCache(m, 20, 4))
    with pytest.raises(KVSimdValueError, match="sliding-window"):
        kt.KVSimdSinkCache(tiny("mistral-window"), 20, 4)
    with pytest.raises(KVSimdValueError, match="dropout"):
        kt.attention(m.model.layers[0].self_attn, torch.ones(1, 4, 1, 16), torch.ones(1, 2, 1, 16),
                     torch.ones(1, 2, 1, 16), None, dropout=0.1)
    with pytest.raises(KVSimdValueError, match="4-D"):
        kt.attention(m.model.layers[0].self_attn, torch.ones(1, 4, 1, 16), torch.ones(1, 2, 1, 16),
                     torch.ones(1, 2, 1, 16), torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(KVSimdError):
        kt.KVSimdCache(m, dtype="int3")
    with pytest.raises(KVSimdTypeError, match="capacity must be an integer, got 'abc'"):
        kt.KVSimdCache(m, capacity="abc")
    with pytest.raises(KVSimdTypeError, match="capacity must be an integer, got 1.7"):
        kt.KVSimdCache(m, capacity=1.7)
    with pytest.raises(KVSimdValueError, match="capacity must be >= 1"):
        kt.KVSimdCache(m, capacity=0)
    with pytest.raises(KVSimdValueError, match="hadamard=True applies to quantized caches .* dtype=float16"):
        kt.KVSimdCache(m, hadamard=True)
    with pytest.raises(KVSimdTypeError, match="hadamard must be a bool, got 'yes'"):
        kt.KVSimdSinkCache(m, 20, 4, dtype="int4", hadamard="yes")
    with pytest.raises(KVSimdValueError, match="recent=4 with dtype=float16"):
        kt.KVSimdCache(m, recent=4)
    with pytest.raises(KVSimdValueError, match="recent must be in 0..16777216, got -1"):   # KVCache's rule
        kt.KVSimdCache(m, dtype="int4", recent=-1)
    with pytest.raises(KVSimdValueError, match="recent must be in 0..16777216, got 1099511627776"):
        kt.KVSimdCache(m, dtype="int4", recent=2**40)
    with pytest.raises(KVSimdTypeError, match="recent must be an integer, got 'x'"):
        kt.KVSimdCache(m, dtype="int4", recent="x")
    with pytest.raises(KVSimdValueError, match="s_aux"):        # e.g. gpt-oss's learned attention sinks
        kt.attention(m.model.layers[0].self_attn, torch.ones(1, 4, 1, 16), torch.ones(1, 2, 1, 16),
                     torch.ones(1, 2, 1, 16), None, s_aux=torch.zeros(4))


def test_a_failed_pass_leaves_the_sink_cache_as_it_was():
    m = tiny("llama", seed=2)
    m.set_attn_implementation(kt.NAME)
    cache = kt.KVSimdSinkCache(m, window=8, n_keep=2, dtype="float32")
    m.generate(prompt(3, n=6), max_new_tokens=20, do_sample=False, past_key_values=cache, pad_token_id=0)
    before = (cache.kv.tokens, cache.kv.head.copy(), cache.kv.seen.copy(), cache.kv.keys(0, 0, 10).copy())
    k = torch.ones(1, 2, 1, 16)
    cache.update(k, k, 0)          # a pass that evicts a token, then fails before its last layer
    cache._abort()
    after = (cache.kv.tokens, cache.kv.head.copy(), cache.kv.seen.copy(), cache.kv.keys(0, 0, 10).copy())
    assert before[0] == after[0] and (before[1] == after[1]).all() and (before[2] == after[2]).all()
    assert np.array_equal(before[3], after[3])


@pytest.fixture(scope="module")
def smollm2():
    from kvsimd.loaders import registry as models
    pytest.importorskip("gguf")
    from kvsimd.bench.hf import transformers_from_gguf
    # transformers' own GGUF load (its float32 dequantization and tokenizer), kept converted
    return transformers_from_gguf(models.smollm2_path(), tokenizer=True)


def agree_until_a_near_tie(got, got_log, ref, ref_log, n0, most=0.1):
    """Greedy tokens of two runs over 4-bit K/V equal, or equal up to a step where they part at a
    near tie: the reference's logit of the other run's token within the two runs' logit
    disagreement at that step of its best, and that disagreement at most ``most`` of the logits.
    Over the same stored values the runs' K/V still differ by float32 rounding (kvsimd's attention
    against eager's, layer after layer), and a 4-bit value that lies that close to a rounding
    boundary rounds the other way in one of them: which prompt meets one, and at which step, is
    luck (measured with four prompts: none, or at the prefill or the 15th or 20th token)."""
    g, r = got[0, n0:].tolist(), ref[0, n0:].tolist()
    i = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
    if i is None:
        return len(g) == len(r)
    want, gl = ref_log[i, 0].astype(np.float64), got_log[i, 0].astype(np.float64)
    apart = np.abs(want - gl).max()
    return apart <= most * np.abs(want).max() and want[r[i]] - want[g[i]] <= apart


def test_smollm2_through_transformers_gguf(smollm2):
    """The real model as transformers loads it: greedy tokens of kvsimd's backend and caches equal
    transformers' own (SDPA, DynamicCache), logits within the bounds.  The int4 cache (heads of 64:
    two blocks turned by H) gives the greedy tokens of transformers' eager attention over the values
    it stores (:func:`agree_until_a_near_tie`), which differ from the float model's.  Its logits:
    measured 1e-6 of that reference's until a 4-bit value rounds the other way from float32 K/V
    that differ by rounding (kvsimd's attention against eager's, 30 layers deep: here in the
    prefill's 13th layer, then 3e-2 and a near tie at the 20th new token), while the float model's
    are 9.4e-2 away (the reference model's int4 test: tests/test_reference_model.py)."""
    m, tok = smollm2
    ids = tok("The old king said to his daughters:", return_tensors="pt").input_ids
    ref_tok, ref_log = run(m, ids, "sdpa", n=32)
    for dtype in ("float32", "float16"):
        got_tok, got_log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype=dtype), n=32)
        assert torch.equal(got_tok, ref_tok), dtype
        assert rel(got_log, ref_log) <= REFERENCE_BOUNDS[dtype], (dtype, rel(got_log, ref_log))
    ref_tok4, ref_log4 = run(m, ids, stored_eager(("int4", True)), n=32)
    got_tok, got_log = run(m, ids, kt.NAME, kt.KVSimdCache(m, dtype="int4"), n=32)
    assert agree_until_a_near_tie(got_tok, got_log, ref_tok4, ref_log4, ids.shape[1])
    assert not torch.equal(ref_tok4, ref_tok)
    sink_tok, _ = run(m, ids, kt.NAME, kt.KVSimdSinkCache(m, window=256, n_keep=4), n=32)
    assert torch.equal(sink_tok, ref_tok)          # inside the window the sink cache is the plain one


# ------------------------------------------------------------------ an attacker's probe (stop 51)
def test_a_cache_made_for_a_deeper_model_is_refused_not_silently_never_filled():
    """A KVSimdCache of a 2-layer model used by a 1-layer one (same heads and head dim) never saw
    its last layer attended, so no pass ever joined it and every step attended to its own tokens
    only, with no error; now the first attention refuses it and leaves it empty."""
    shallow, deep = tiny("llama", num_hidden_layers=1), tiny("llama", num_hidden_layers=2)
    kt.enable(shallow)
    kt.enable(deep)
    cache = kt.KVSimdCache(deep)
    ids = torch.tensor([[5, 9, 11, 3]])
    with pytest.raises(KVSimdValueError, match="made for a model of 2 layers.*model of 1"):
        shallow.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() == 0
    own = kt.KVSimdCache(shallow)      # the right cache still works
    out = shallow.generate(ids, past_key_values=own, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and own.get_seq_length() == 7


@pytest.mark.parametrize("call, error, message", [
    ("cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), '0')", KVSimdValueError,
     "layer '0' updated out of order"),
    ("kt.attention(Mod(), torch.randn(2, 4, 3, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), "
     "torch.ones(1, 5, dtype=torch.bool))", KVSimdValueError, "attention_mask has 1 rows for a batch of 2"),
    ("kt.attention(Mod(), torch.randn(4, 3, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), None)",
     KVSimdValueError, "query must be a [batch, heads, tokens, head_dim] tensor, got (4, 3, 16)"),
    ("kt.attention(Mod(), torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), None, "
     "softcap='a')", KVSimdTypeError, "softcap must be a number, got 'a'"),
    ("kt.attention(Mod(), torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), None, "
     "dropout=torch.ones(2))", KVSimdTypeError, "dropout must be a number"),
    ("kt.attention_mask(1, 3, 5, attention_mask=np.ones((1, 5)))", KVSimdValueError,
     "must be a 2-D tensor [batch, keys], got ndarray"),
])
def test_malformed_backend_arguments_are_kvsimd_errors(call, error, message):
    """Direct calls of the backend's functions with arguments transformers never passes: each
    raised numpy's, torch's or Python's own exception before."""
    class Mod:
        is_causal = True
    cache = kt.KVSimdCache(tiny("llama"))   # noqa: F841  (used by the calls)
    with pytest.raises(error) as e:
        eval(call, {"torch": torch, "np": np, "kt": kt, "Mod": Mod, "cache": cache})
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("edit, message", [
    ("m.config.rope_parameters = {'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': float('nan')}",
     "partial_rotary_factor"),
    ("m.config.rope_parameters = {'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': float('inf')}",
     "partial_rotary_factor"),
    # past transformers' own check (a config object filled in another way)
    ("m.config.__dict__['layer_types'] = [['full_attention'], 'x']", "layer_types must be a list of 2 strings"),
    ("m.config.model_type = ['llama']", "model family ['llama'] is not supported"),
])
def test_from_transformers_refuses_odd_config_values(edit, message):
    m = tiny("qwen2")
    exec(edit, {"m": m})
    with pytest.raises(KVSimdError) as e:
        Decoder.from_transformers(m)
    assert message in str(e.value), str(e.value)
