"""Decoders against Hugging Face transformers on the same (tiny, random) weights.

Bounds: logits relative to the largest |logit| of the reference, max over positions:
  float32 cache: <= 1e-4.   float16 cache: <= 2e-2 (K/V rounded to fp16 once, 2^-11 relative,
  through two layers of attention and the LM head; measured ~2e-3).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the model tests need the test extra: torch==2.13.0")
transformers = pytest.importorskip("transformers", reason="the model tests need the test extra: transformers")

import kvsimd  # noqa: E402
from kvsimd import Decoder, EncoderDecoder, KVSimdCapacityError  # noqa: E402
from kvsimd.bench.complexity import PositionCounter, greedy_counting  # noqa: E402
from kvsimd.observe import observe  # noqa: E402

transformers.logging.set_verbosity_error()
V = 97


def causal_models():
    T = transformers
    return {
        "llama": T.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512),
        "qwen2-bias": T.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                                    max_position_embeddings=512, rope_theta=1e5),
        "gpt_neox": T.GPTNeoXConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=512),
        "gpt_neox-sequential": T.GPTNeoXConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=False,
                                               max_position_embeddings=512),
        "gpt2": T.GPT2Config(vocab_size=V, n_embd=48, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                             eos_token_id=2),
        "bloom": T.BloomConfig(vocab_size=V, hidden_size=48, n_layer=2, n_head=4),
        # the families of the GGUF architectures (tests/test_families.py loads them from GGUF files)
        "mistral-window": T.MistralConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                                          max_position_embeddings=512),
        "qwen2-window": T.Qwen2Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                      sliding_window=16, max_window_layers=1, max_position_embeddings=512),
        "qwen3": T.Qwen3Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
        "phi3": T.Phi3Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
                             sliding_window=None, max_position_embeddings=512, pad_token_id=0),
        "phi3-window": T.Phi3Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, sliding_window=16,
                                    max_position_embeddings=512, pad_token_id=0),
        "gemma2": T.Gemma2Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=1, initializer_range=0.2,
                                 attn_logit_softcapping=0.5, final_logit_softcapping=3.0, sliding_window=16,
                                 max_position_embeddings=512, pad_token_id=0),
    }


def seq2seq_models():
    T = transformers
    return {
        "bart": (T.BartForConditionalGeneration, T.BartConfig(
            vocab_size=V, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=1100)),
        "marian": (T.MarianMTModel, T.MarianConfig(
            vocab_size=V, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=512,
            pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0, scale_embedding=True,
            activation_function="swish")),
    }


_CACHE = {}


def causal(name):
    if name not in _CACHE:
        torch.manual_seed(sum(map(ord, name)))
        m = transformers.AutoModelForCausalLM.from_config(causal_models()[name]).eval()
        _CACHE[name] = (m, Decoder.from_transformers(m))
    return _CACHE[name]


def seq2seq(name):
    if name not in _CACHE:
        torch.manual_seed(sum(map(ord, name)))
        cls, cfg = seq2seq_models()[name]
        m = cls(cfg).eval()
        _CACHE[name] = (m, EncoderDecoder.from_transformers(m))
    return _CACHE[name]


def hf_logits(m, toks):
    with torch.no_grad():
        return m(torch.tensor(np.asarray(toks)[None])).logits[0].double().numpy()


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


TOL = {"float32": 1e-4, "float16": 2e-2}


@pytest.mark.parametrize("name", list(causal_models()))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_and_32_steps_match_transformers(name, dtype, rng):
    m, d = causal(name)
    toks = rng.integers(0, V, 45)
    ref = hf_logits(m, toks)
    cache = d.new_cache(capacity=64, dtype=dtype)
    errs = [rel(d.prefill(toks[:13], cache=cache, all_logits=True), ref[:13])]
    for i in range(13, 45):
        errs.append(rel(d.step([toks[i]], cache=cache)[0], ref[i]))
    assert max(errs) <= TOL[dtype], (name, dtype, max(errs))
    assert cache.length() == 45


@pytest.mark.parametrize("name", list(causal_models()))
@pytest.mark.parametrize("policy", ["fixed", "ring"])
def test_batched_decode_steps_equal_each_sequence_alone(name, policy, rng):
    """Decode steps of a batch of 2 (rows of one compiled pass, one ring per sequence) give each
    sequence the logits it gets alone, through ring wraps (sink_query, or reevaluate for learned
    positions); without a ring they also equal the uncached pass over the whole prefix."""
    m, d = causal(name)
    if policy == "ring":
        policy = "reevaluate" if d.cfg.position == "learned" else "sink_query"
    toks = rng.integers(0, V, (2, 40))
    n = 16 if policy == "fixed" else 34   # 34 steps wrap the 22-slot window
    kw = dict(capacity=24, n_keep=2, policy=policy, dtype="float32")
    cache = d.new_cache(batch=2, **kw)
    for b in range(2):
        d.prefill(toks[b, :5 + 3 * b], seq=b, cache=cache)
    both = np.stack([d.step(list(toks[:, 5 + i]), cache=cache) for i in range(n)])
    for b in range(2):
        alone = d.new_cache(batch=1, **kw)
        d.prefill(toks[b, :5 + 3 * b], cache=alone)
        for i in range(n):
            assert rel(both[i, b], d.step([toks[b, 5 + i]], cache=alone)[0].astype(np.float64)) <= 1e-5
            if policy == "fixed":
                prefix = list(toks[b, :5 + 3 * b]) + list(toks[b, 5:6 + i])
                assert rel(both[i, b], d.forward(prefix)[-1].astype(np.float64)) <= 1e-4


@pytest.mark.parametrize("name", list(causal_models()))
def test_greedy_tokens_identical_to_transformers(name, rng):
    m, d = causal(name)
    prompt = list(rng.integers(0, V, 7))
    ours = list(d.generate(prompt, max_new_tokens=32, cache_dtype="float32"))
    seq = list(prompt)
    with torch.no_grad():
        past = None
        inp = torch.tensor([seq])
        for _ in range(32):
            out = m(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
            seq.append(nxt)
            inp = torch.tensor([[nxt]])
    assert ours == seq[len(prompt):]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom"])
def test_batch_equals_one_by_one(name, rng):
    _, d = causal(name)
    prompts = [list(rng.integers(0, V, n)) for n in (3, 11, 6)]
    batch = list(d.generate(prompts, max_new_tokens=10, cache_dtype="float32"))
    for b, p in enumerate(prompts):
        alone = list(d.generate(p, max_new_tokens=10, cache_dtype="float32"))
        assert [step[b] for step in batch] == alone
    # and the logits, step by step
    cache = d.new_cache(batch=3, capacity=32, dtype="float32")
    last = np.stack([d.prefill(p, cache=cache, seq=b) for b, p in enumerate(prompts)])
    nxt = last.argmax(1)
    lb = d.step(nxt, cache=cache)
    for b, p in enumerate(prompts):
        c1 = d.new_cache(capacity=32, dtype="float32")
        d.prefill(p, cache=c1)
        assert rel(d.step([nxt[b]], cache=c1)[0], lb[b].astype(np.float64)) < 1e-6


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "bloom"])
def test_cached_equals_uncached_recomputation(name, rng):
    _, d = causal(name)
    toks = rng.integers(0, V, 30)
    cache = d.new_cache(capacity=32, dtype="float32")
    cached = [d.prefill(toks[:5], cache=cache)]
    cached += [d.step([t], cache=cache)[0] for t in toks[5:]]
    full = d.forward(toks)
    assert rel(np.stack(cached), full[4:].astype(np.float64)) < 1e-5


@pytest.mark.parametrize("name", list(seq2seq_models()))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_encoder_decoder_matches_transformers(name, dtype, rng):
    m, d = seq2seq(name)
    start = m.config.decoder_start_token_id
    src = rng.integers(3, V - 1, 23)
    tgt = np.concatenate([[start], rng.integers(3, V - 1, 33)])
    with torch.no_grad():
        ref = m(input_ids=torch.tensor(src[None]), decoder_input_ids=torch.tensor(tgt[None])).logits[0].double().numpy()
    cross = d.cross_for([src], dtype)
    cache = d.new_cache(capacity=40, dtype=dtype)
    errs = [rel(d.prefill(tgt[:2], cache=cache, cross=cross, all_logits=True), ref[:2])]
    for i in range(2, len(tgt)):
        errs.append(rel(d.step([tgt[i]], cache=cache, cross=cross)[0], ref[i]))
    assert max(errs) <= TOL[dtype], max(errs)
    assert rel(d.forward(src, tgt), ref) <= 1e-4


@pytest.mark.parametrize("name", list(seq2seq_models()))
def test_encoder_decoder_greedy_and_batch(name, rng):
    m, d = seq2seq(name)
    srcs = [list(rng.integers(3, V - 1, n)) for n in (9, 17, 4)]
    batch = list(d.generate(srcs, max_new_tokens=12, cache_dtype="float32", stop_tokens=()))
    for b, s in enumerate(srcs):
        alone = list(d.generate(s, max_new_tokens=12, cache_dtype="float32", stop_tokens=()))
        assert [step[b] for step in batch] == alone
        # greedy by transformers, without cache
        seq = [m.config.decoder_start_token_id]
        with torch.no_grad():
            for _ in range(12):
                lg = m(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(lg.argmax()))
        assert alone == seq[1:]


@pytest.mark.parametrize("name", list(seq2seq_models()))
def test_cached_decode_steps_equal_the_uncached_pass_encoder_decoder(name, rng):
    """Post-norm decoders with cross-attention (BART, Marian), a batch of sources of different
    lengths: each cached step's logits equal the uncached pass over the same target prefix."""
    m, d = seq2seq(name)
    srcs = [list(rng.integers(3, V - 1, n)) for n in (9, 17)]
    toks = rng.integers(3, V - 1, (2, 12))
    start = m.config.decoder_start_token_id
    cross = d.cross_for(srcs, dtype="float32")
    cache = d.new_cache(batch=2, capacity=16, dtype="float32")
    for b in range(2):
        d.prefill([start], seq=b, cache=cache, cross=cross)
    enc = [d.encode(s) for s in srcs]
    for i in range(12):
        logits = d.step(list(toks[:, i]), cache=cache, cross=cross)
        for b in range(2):
            full = d.forward(srcs[b], [start] + list(toks[b, :i + 1]), enc_out=enc[b])[-1]
            assert rel(logits[b], full.astype(np.float64)) <= 1e-4


def test_cross_attention_projected_once_per_request_and_layer(rng):
    _, d = seq2seq("bart")
    srcs = [list(rng.integers(3, V - 1, 10)), list(rng.integers(3, V - 1, 6))]
    with observe(d, PositionCounter()) as count:
        cross = d.cross_for(srcs)
        assert count.projections == d.cfg.n_layers * 2
        cache = d.new_cache(batch=2, capacity=30)
        start = d.cfg.decoder_start_token_id
        logits = np.stack([d.prefill([start], cache=cache, cross=cross, seq=b) for b in range(2)])
        for _ in range(20):
            logits = d.step(logits.argmax(1), cache=cache, cross=cross)
    assert count.projections == d.cfg.n_layers * 2     # decoding never re-projects


def test_complexity_accounting_seed_003():
    """N = 1024 source tokens, M = 100 generated: 107,450 / 6,074 / 1,124 token positions."""
    torch.manual_seed(3)
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                  decoder_ffn_dim=16, max_position_embeddings=1100)
    d = EncoderDecoder.from_transformers(transformers.BartForConditionalGeneration(cfg).eval())
    src = list(np.random.default_rng(0).integers(3, V, 1024))
    totals, outs = {}, {}
    for regime in ("none", "encoder", "cached"):
        toks, enc, dec = greedy_counting(d, src, 100, regime=regime)
        totals[regime], outs[regime] = enc + dec, toks
    assert totals == {"none": 107_450, "encoder": 6_074, "cached": 1_124}
    assert outs["none"] == outs["encoder"] == outs["cached"]   # same tokens, whatever the regime


def test_sampling_is_seeded_and_truncates(rng):
    _, d = causal("llama")
    p = list(rng.integers(0, V, 5))
    a = list(d.generate(p, max_new_tokens=15, temperature=0.8, seed=7))
    b = list(d.generate(p, max_new_tokens=15, temperature=0.8, seed=7))
    c = list(d.generate(p, max_new_tokens=15, temperature=0.8, seed=8))
    greedy = list(d.generate(p, max_new_tokens=15))
    assert a == b and a != c
    assert list(d.generate(p, max_new_tokens=15, temperature=1.5, top_k=1, seed=1)) == greedy
    assert list(d.generate(p, max_new_tokens=15, temperature=1.5, top_p=1e-9, seed=1)) == greedy


def test_stop_tokens_and_max_new_tokens(rng):
    _, d = causal("gpt2")
    p = list(rng.integers(0, V, 5))
    greedy = list(d.generate(p, max_new_tokens=20))
    assert len(greedy) == 20
    stop = greedy[5]
    first = greedy.index(stop)
    # the stop token ends the stream and is not yielded
    assert list(d.generate(p, max_new_tokens=20, stop_tokens=[stop])) == greedy[:first]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_stop_token_matches_transformers_without_the_eos(name, rng):
    """transformers' generate includes the eos token that ends it; kvsimd's does not yield it."""
    m, d = causal(name)
    prompt = list(rng.integers(0, V, 6))
    ours_free = list(d.generate(prompt, max_new_tokens=16, cache_dtype="float32"))
    eos = ours_free[4]
    with torch.no_grad():
        hf = m.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert hf[-1] == eos and eos not in hf[:-1]
    assert list(d.generate(prompt, max_new_tokens=16, cache_dtype="float32", stop_tokens=[eos])) == hf[:-1]


def test_bad_input_raises_and_leaves_cache_unchanged(rng):
    _, d = causal("llama")
    cache = d.new_cache(batch=2, capacity=16)
    d.prefill([1, 2, 3], cache=cache, seq=0)
    d.prefill([4, 5], cache=cache, seq=1)
    k0 = cache.keys(0, 0).copy()
    before = cache.lengths

    def same():
        assert np.array_equal(cache.lengths, before) and np.array_equal(cache.keys(0, 0), k0)

    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.step([3, V + 5], cache=cache)
    same()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        d.prefill([-1], cache=cache)
    same()
    with pytest.raises(ValueError, match="non-empty"):
        d.prefill([], cache=cache)
    same()
    with pytest.raises(ValueError, match="one token per sequence"):
        d.step([1, 2, 3], cache=cache)
    same()
    with pytest.raises(TypeError, match="integer token ids, got dtype float64"):
        d.step(np.array([1.0, 2.0]), cache=cache)
    same()
    with pytest.raises(KVSimdCapacityError, match="exceeds capacity 16"):
        d.prefill(list(range(20)), cache=cache, seq=1)
    same()
    with pytest.raises(ValueError, match="seq must be in 0..1"):
        d.prefill([1], cache=cache, seq=2)
    same()
    full = d.new_cache(capacity=4)
    d.prefill([1, 2, 3, 4], cache=full)
    with pytest.raises(KVSimdCapacityError, match="cache full"):
        d.step([5], cache=full)
    assert full.length() == 4


def test_unsupported_family_is_named():
    torch.manual_seed(0)
    m = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, ffn_dim=16))
    with pytest.raises(ValueError, match="model family 'opt' is not supported"):
        Decoder.from_transformers(m)
    with pytest.raises(ValueError, match="model family 'opt' is not supported"):
        EncoderDecoder.from_transformers(m)


def test_repr_names_the_isa():
    _, d = causal("llama")
    assert kvsimd.active_isa() in repr(d) and "llama" in repr(d)


def _tiny_llama(**rope):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters=dict({"rope_type": "default", "rope_theta": 10000.0}, **rope)))


def test_from_transformers_reads_config_fields_as_transformers_does():
    """A field present as None (partial_rotary_factor=None, as transformers may write it) means its
    default: the model loads and matches transformers.  rope_theta 0 or a string, and a Gemma 2
    query_pre_attn_scalar of 0 or below, are KVSimdErrors naming the field (0 was read as unset and
    became 10000; the others were bare TypeError / ZeroDivisionError)."""
    m = _tiny_llama(partial_rotary_factor=None)
    ids = [1, 2, 3, 4]
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0].numpy()
    got = Decoder.from_transformers(m).forward(ids)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    for bad, err in ((0.0, "rope_theta must be a positive finite number"), ("abc", "rope_theta must be a real number")):
        m = _tiny_llama()
        m.config.rope_parameters["rope_theta"] = bad
        with pytest.raises(kvsimd.KVSimdError, match=err):
            Decoder.from_transformers(m)
    g = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    for bad in (0, -3):
        g.config.query_pre_attn_scalar = bad
        with pytest.raises(kvsimd.KVSimdValueError, match="query_pre_attn_scalar must be a finite number > 0"):
            Decoder.from_transformers(g)


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_encoder_decoder_with_other_head_counts_per_stack(family):
    """An encoder of 2 heads under a decoder of 4 (transformers splits d_model per stack) loads
    and matches transformers (the encoder's head size used to be the decoder's)."""
    torch.manual_seed(1)
    kw = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    if family == "bart":
        hf = transformers.BartForConditionalGeneration(transformers.BartConfig(**kw))
    else:
        hf = transformers.MarianMTModel(transformers.MarianConfig(decoder_start_token_id=0, pad_token_id=0, **kw))
    hf.eval()
    src, tgt = [5, 6, 7, 2], [2, 8, 9]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt])).logits[0].numpy()
    got = EncoderDecoder.from_transformers(hf).forward(src, tgt)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
