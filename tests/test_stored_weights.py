"""Models whose matrices are kept as stored (kvsimd.QMatrix): ``from_transformers(weights=...)``
for every family of the transformers tests, against the float64 reference on the same stored
weights (gguf's dequantization, not kvsimd's) and against transformers (the stated quantization
bounds), plus the packing rules (fused parts keep their types; a tied head shares the embedding)."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsimd import Decoder, EncoderDecoder, KVSimdError, QMatrix  # noqa: E402
from kvsimd.testing import INT8_ACTIVATION_BOUND, assert_matches_reference  # noqa: E402

transformers.logging.set_verbosity_error()
V = 97
# Bound on max |kvsimd - transformers| / max |transformers logit| of a prompt's logits, by the
# stored type of the matrices (tiny random models of width 64; measured 2026-11-24: float16
# <= 5e-4, bfloat16 <= 4e-3, q8_0 <= 1e-2): the weights' own rounding, which transformers'
# float32 weights do not have.  Against the float64 reference on the same stored weights the
# bound is the float32 one (kvsimd.testing.REFERENCE_BOUNDS).
HF_BOUND = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.5e-2, "q8_0": 3e-2}
WTYPE = {"float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}


def families():
    T = transformers
    kw = dict(vocab_size=V, max_position_embeddings=512)
    return {
        "llama": lambda: T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, **kw),
        "qwen2-bias": lambda: T.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                                            rope_theta=1e5, **kw),
        "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, rotary_pct=0.5, **kw),
        "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=512),
        "bloom": lambda: T.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4),
    }


SEQ2SEQ = {
    "bart": lambda: (transformers.BartForConditionalGeneration, transformers.BartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=512)),
    "marian": lambda: (transformers.MarianMTModel, transformers.MarianConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=512,
        pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0, scale_embedding=True)),
}
_HF = {}


def hf_causal(name):
    if name not in _HF:
        torch.manual_seed(sum(map(ord, name)))
        _HF[name] = transformers.AutoModelForCausalLM.from_config(families()[name]()).eval()
    return _HF[name]


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


def matrices(d):
    for lw in d.layers:
        yield from (lw.attn.wq, lw.attn.wk, lw.attn.wv, lw.attn.wo, lw.ffn.w1, lw.ffn.w2)
    yield d.embed


@pytest.mark.parametrize("name", list(families()))
@pytest.mark.parametrize("weights", list(HF_BOUND))
def test_causal_families_with_stored_weights(name, weights, rng):
    m = hf_causal(name)
    d = Decoder.from_transformers(m, weights=weights)
    for w in matrices(d):
        if weights == "float32":
            assert isinstance(w, np.ndarray)
        else:
            assert isinstance(w, QMatrix) and w.wtype == WTYPE[weights], w
    toks = rng.integers(0, V, 57)
    with torch.no_grad():
        ref = m(torch.tensor(toks[None])).logits[0].double().numpy()
    cache = d.new_cache(capacity=60, dtype="float32")
    # a prefill chunk of 45 rows (stored weights: dequantized tiles through BLAS), then one of 4 rows
    # (the kernel), then single steps
    prefill = np.concatenate([d.prefill(toks[:45], cache=cache, all_logits=True),
                              d.prefill(toks[45:49], cache=cache, all_logits=True)])
    steps = [d.step([t], cache=cache)[0] for t in toks[49:]]
    got = np.concatenate([prefill, np.stack(steps)])
    # the same stored weights, float64 (q8_0: x rounded to int8 as the kernels do)
    assert_matches_reference(d, toks, got, bound=INT8_ACTIVATION_BOUND if weights == "q8_0" else None)
    assert rel(got, ref) <= HF_BOUND[weights], (name, weights, rel(got, ref))
    # decode of a batch of rows (B = 3) equals each row alone (to float32 summation order)
    c3 = d.new_cache(capacity=40, batch=3, dtype="float32")
    for s in range(3):
        d.prefill(toks[:5 + s], cache=c3, seq=s)
    batch = d.step([1, 2, 3], cache=c3)
    for s in range(3):
        c1 = d.new_cache(capacity=40, dtype="float32")
        d.prefill(toks[:5 + s], cache=c1)
        assert rel(batch[s], d.step([s + 1], cache=c1)[0].astype(np.float64)) < 1e-5


@pytest.mark.parametrize("name", list(SEQ2SEQ))
@pytest.mark.parametrize("weights", ["float16", "q8_0"])
def test_encoder_decoder_with_stored_weights(name, weights, rng):
    torch.manual_seed(1)
    cls, cfg = SEQ2SEQ[name]()
    m = cls(cfg).eval()
    d = EncoderDecoder.from_transformers(m, weights=weights)
    assert isinstance(d.layers[0].cross.wq, QMatrix) and isinstance(d.enc_layers[0].attn.wq, QMatrix)
    src = rng.integers(3, V - 1, 19)
    tgt = np.concatenate([[m.config.decoder_start_token_id], rng.integers(3, V - 1, 11)])
    with torch.no_grad():
        ref = m(input_ids=torch.tensor(src[None]), decoder_input_ids=torch.tensor(tgt[None])).logits[0].double().numpy()
    got = d.forward(src, tgt)
    assert_matches_reference(d, tgt, got, src=src, bound=INT8_ACTIVATION_BOUND if weights == "q8_0" else None)
    assert rel(got, ref) <= HF_BOUND[weights], rel(got, ref)


def test_tied_head_shares_the_stored_embedding_and_fused_parts_keep_their_types():
    g = Decoder.from_transformers(hf_causal("gpt2"), weights="q8_0")
    assert g.lm_head is g.embed            # tie_word_embeddings: one stored table
    d = Decoder.from_transformers(hf_causal("llama"), weights="q8_0")
    assert d.lm_head is not d.embed        # (Llama does not tie them)
    d.forward([1, 2])                      # validates and packs
    packed = d._packed.layers.blocks[0]
    assert packed.qkv.parts == (d.layers[0].attn.wq, d.layers[0].attn.wk, d.layers[0].attn.wv)
    assert packed.ffn_in.parts == (d.layers[0].ffn.w1, d.layers[0].ffn.w3)


def test_inputs_that_are_not_whole_blocks_fall_back_to_float16_and_say_so():
    torch.manual_seed(0)
    m = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)
    m = transformers.AutoModelForCausalLM.from_config(m).eval()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        d = Decoder.from_transformers(m, weights="q8_0")
    msg = " ".join(str(w.message) for w in ws)
    assert "layers[0].attn.wq (48 inputs)" in msg and "stored as float16" in msg, msg
    assert d.layers[0].attn.wq.wtype == "f16" and d.layers[0].ffn.w2.wtype == "q8_0"   # w2 has 64 inputs
    toks = np.arange(1, 9)
    assert_matches_reference(d, toks, d.forward(toks), bound=INT8_ACTIVATION_BOUND)   # w2: int8 activations


@pytest.mark.parametrize("bad", ["int4", "Q8_0", None, 8])
def test_unknown_weights_format_is_refused(bad):
    with pytest.raises(KVSimdError, match=r"weights must be one of 'float32', 'float16', 'bfloat16', 'q8_0', got"):
        Decoder.from_transformers(hf_causal("llama"), weights=bad)
