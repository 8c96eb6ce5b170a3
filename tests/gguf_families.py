"""Tiny GGUF files of each supported architecture, written from a random transformers model the
way llama.cpp's converter lays them out (tensor names, the q/k row permutation of the llama
architecture, Gemma's norms stored as 1 + w, Phi-3's fused tensors, metadata keys), so that
kvsimd and transformers (``gguf_file=``) load the same bytes.

The shapes are the smallest that real files' constraints allow: rows of 256 values (k-quant
blocks), Qwen3 heads of 128 and Gemma 2 heads of 256 (transformers' GGUF loader takes its
Qwen3Config / Gemma2Config defaults for them: 128 and a query scale of 256 ** -0.5).
"""
import numpy as np

import gguf

T = gguf.GGUFValueType
D, FFN, LAYERS = 256, 512, 2
# each family's tokenizer as its real files have it (tests/ggufmodels.py: kind, family)
TOKENIZERS = {"llama": ("llama", "llama2"), "mistral": ("llama", "mistral"), "qwen2": ("gpt2", "qwen2"),
              "qwen3": ("gpt2", "qwen3"), "phi3": ("llama", "phi3"), "gemma2": ("llama", "gemma2")}
_TOK = {}


def tokenizer(family):
    """(metadata, TokenizerInfo) of ``family``'s tokenizer (made once)."""
    if family not in _TOK:
        import ggufmodels
        _TOK[family] = ggufmodels.tokenizer_metadata(*TOKENIZERS[family])
    return _TOK[family]


def vocab(family):
    return len(tokenizer(family)[1].tokens)


def hf_configs():
    """name -> (GGUF architecture, general.name, transformers config)."""
    import transformers as tf
    return {f: (arch, name, cls(**kw, **_common(f))) for f, (arch, name, cls, kw) in _families(tf).items()}


def _common(family):
    info = tokenizer(family)[1]
    return dict(vocab_size=vocab(family), hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                max_position_embeddings=1024, initializer_range=0.05, bos_token_id=info.bos_id,
                eos_token_id=info.eos_id, pad_token_id=info.pad_id if info.pad_id is not None else 0)


def _families(tf):
    return {
        "llama": ("llama", "tiny-llama", tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
        "mistral": ("llama", "tiny-mistral", tf.MistralConfig,
                    dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6)),
        "qwen2": ("qwen2", "tiny-qwen2", tf.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                                              rope_theta=1e6)),
        "qwen3": ("qwen3", "tiny-qwen3", tf.Qwen3Config, dict(num_attention_heads=2, num_key_value_heads=1,
                                                              head_dim=128, rope_theta=1e6)),
        "phi3": ("phi3", "tiny-phi3", tf.Phi3Config, dict(num_attention_heads=4, num_key_value_heads=4)),
        "gemma2": ("gemma2", "tiny-gemma2", tf.Gemma2Config,
                   dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    }


def _permute(w, heads):
    """llama.cpp's q/k row order for the llama architecture: within each head, the rows of the two
    rotate_half halves interleaved (GPT-J pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(arch, model):
    """GGUF tensor name -> float32 array (ggml's [out, in] as NumPy [rows, cols]) of ``model``."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    gemma = arch == "gemma2"
    norm = (lambda w: w + np.float32(1.0)) if gemma else (lambda w: w)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": norm(sd["model.norm.weight"])}
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p, g = "model.layers.%d." % i, "blk.%d." % i
        out[g + "attn_norm.weight"] = norm(sd[p + "input_layernorm.weight"])
        if arch == "phi3":
            out[g + "attn_qkv.weight"] = sd[p + "self_attn.qkv_proj.weight"]
            out[g + "ffn_up.weight"] = sd[p + "mlp.gate_up_proj.weight"]
        else:
            q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
            if arch == "llama":
                q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
            out.update({g + "attn_q.weight": q, g + "attn_k.weight": k, g + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                        g + "ffn_gate.weight": sd[p + "mlp.gate_proj.weight"], g + "ffn_up.weight": sd[p + "mlp.up_proj.weight"]})
            for x in "qkv":
                if p + "self_attn.%s_proj.bias" % x in sd:
                    out[g + "attn_%s.bias" % x] = sd[p + "self_attn.%s_proj.bias" % x]
        out[g + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[g + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
        if gemma:
            out[g + "post_attention_norm.weight"] = norm(sd[p + "post_attention_layernorm.weight"])
            out[g + "ffn_norm.weight"] = norm(sd[p + "pre_feedforward_layernorm.weight"])
            out[g + "post_ffw_norm.weight"] = norm(sd[p + "post_feedforward_layernorm.weight"])
        else:
            out[g + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if p + "self_attn.q_norm.weight" in sd:
            out[g + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[g + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
    return out


def metadata(arch, name, c):
    """key -> (value, type): the model metadata llama.cpp writes for ``arch``."""
    a = arch + "."
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    Dh = getattr(c, "head_dim", None) or c.hidden_size // H
    m = {"general.name": (name, T.STRING), a + "context_length": (c.max_position_embeddings, T.UINT32),
         a + "embedding_length": (c.hidden_size, T.UINT32), a + "block_count": (c.num_hidden_layers, T.UINT32),
         a + "feed_forward_length": (c.intermediate_size, T.UINT32), a + "attention.head_count": (H, T.UINT32),
         a + "attention.head_count_kv": (Hkv, T.UINT32), a + "vocab_size": (c.vocab_size, T.UINT32),
         a + "attention.layer_norm_rms_epsilon": (float(c.rms_norm_eps), T.FLOAT32),
         a + "rope.dimension_count": (int(Dh * (getattr(c, "rope_parameters", None) or {}).get(
             "partial_rotary_factor", 1.0)), T.UINT32)}
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    m[a + "rope.freq_base"] = (float(theta), T.FLOAT32)
    if Dh != c.hidden_size // H:
        m[a + "attention.key_length"] = (Dh, T.UINT32)
        m[a + "attention.value_length"] = (Dh, T.UINT32)
    rp = dict(getattr(c, "rope_parameters", None) or {})
    kind = rp.get("rope_type", "default")
    if kind in ("linear", "yarn"):              # llama.cpp's keys (llama3 is the rope_freqs tensor)
        m[a + "rope.scaling.type"] = (kind, T.STRING)
        m[a + "rope.scaling.factor"] = (float(rp["factor"]), T.FLOAT32)
    if kind == "yarn":
        m[a + "rope.scaling.original_context_length"] = (rp["original_max_position_embeddings"], T.UINT32)
    if arch == "phi3" and getattr(c, "sliding_window", None):
        m[a + "attention.sliding_window"] = (c.sliding_window, T.UINT32)
    if arch == "gemma2":
        m[a + "attention.sliding_window"] = (c.sliding_window, T.UINT32)
        m[a + "attn_logit_softcapping"] = (float(c.attn_logit_softcapping), T.FLOAT32)
        m[a + "final_logit_softcapping"] = (float(c.final_logit_softcapping), T.FLOAT32)
    return m


def rope_freqs(c):
    """llama.cpp converter's rope_freqs tensor of a llama3-scaled config (None otherwise): per
    frequency 1 where the wavelength is below original / high_freq_factor, factor above original /
    low_freq_factor, and 1 / ((1 - s) / factor + s) between."""
    import math
    rp = dict(getattr(c, "rope_parameters", None) or {})
    if rp.get("rope_type") != "llama3":
        return None
    Dh = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    f, lo, hi, orig = (rp[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings"))
    out = []
    for b in rp["rope_theta"] ** (-np.arange(0, Dh, 2) / Dh):
        w = 2 * math.pi / b
        s = (orig / w - lo) / (hi - lo)
        out.append(1.0 if w < orig / hi else f if w > orig / lo else 1 / ((1 - s) / f + s))
    return np.array(out, dtype=np.float32)


def _encode(x, qtype):
    """(data, raw_dtype) for GGUFWriter.add_tensor of float32 ``x`` stored as ``qtype``."""
    q = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype == "F32":
        return x, None
    if qtype == "F16":
        return x.astype(np.float16), None
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):    # gguf has no quantizer for them: tests/quantizers.py's
        import quantizers
        return quantizers.quantize(x, qtype.lower()), q
    return gguf.quants.quantize(x, q), q


def write(path, family, model, qtype="F32"):
    """Write ``model`` (a transformers causal LM of ``family``, see hf_configs) as a GGUF file with
    its family's tokenizer: matrices as ``qtype`` (the token embedding too), vectors as F32."""
    arch, name, _ = hf_configs()[family]
    w = gguf.GGUFWriter(path, arch)
    for key, (value, vtype) in {**metadata(arch, name, model.config), **tokenizer(family)[0]}.items():
        if key == "general.name":
            w.add_name(value)
        else:
            w.add_key_value(key, value, vtype)
    tensors = gguf_tensors(arch, model)
    if rope_freqs(model.config) is not None:
        tensors["rope_freqs.weight"] = rope_freqs(model.config)
    for tname, x in tensors.items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        data, raw = _encode(x, qtype if x.ndim == 2 else "F32")
        w.add_tensor(tname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
