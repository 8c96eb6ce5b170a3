"""Load Llama-architecture GGUF files (llama.cpp's format) with the ``gguf`` package.

Metadata gives the configuration; tensors stored as F32, F16, BF16, Q8_0, Q4_0 or Q4_1 are
dequantized to float32 at load with ``gguf``'s own routines.  llama.cpp's converter permutes
the Q/K projection rows so that RoPE rotates adjacent pairs (GPT-J style), so a GGUF model is
run with ``rope_style="gptj"`` on its weights as stored -- equivalent to transformers' NeoX
``rotate_half`` on the unpermuted weights, because q.k is unchanged when q and k are permuted
alike.
"""
from __future__ import annotations

import os

import numpy as np

from kvsimd.errors import KVSimdError, KVSimdValueError
from kvsimd.layers import F32, AttentionWeights, FFNWeights, LayerWeights, ModelConfig, NormWeights

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


class GGUFError(KVSimdError, ValueError):
    """A GGUF file that is missing, damaged, or of an architecture/tensor type not supported."""


def open_gguf(path):
    import gguf
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError("GGUF file not found: %s" % path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/... on damaged files
        raise GGUFError("%s is not a readable GGUF file (truncated or damaged?): %s" % (path, e)) from None


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader, path="<gguf>"):
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError("%s: architecture %r is not supported (supported: llama)" % (path, arch))
    need = lambda k: _need(reader, "llama." + k, path)  # noqa: E731
    d, H = int(need("embedding_length")), int(need("attention.head_count"))
    Hkv = int(field(reader, "llama.attention.head_count_kv", H))
    head_dim = int(field(reader, "llama.attention.key_length", d // H))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, "llama.vocab_size", len(tokens) if tokens is not None else 0))
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=int(need("block_count")), n_heads=H, n_kv_heads=Hkv,
        head_dim=head_dim, ffn_dim=int(need("feed_forward_length")), activation="silu", ffn_gated=True,
        norm="rmsnorm", norm_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        position="rope", rope_theta=float(field(reader, "llama.rope.freq_base", 10000.0)), rope_style="gptj",
        rotary_dim=int(field(reader, "llama.rope.dimension_count", head_dim)),
        max_positions=int(field(reader, "llama.context_length", 4096)),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=None if eos is None else int(eos),
        family="llama-gguf")


def _need(reader, key, path):
    v = field(reader, key)
    if v is None:
        raise GGUFError("%s: metadata key %s is missing" % (path, key))
    return v


def load_tensors(reader, path="<gguf>"):
    """name -> float32 array in ggml's row-major order ([out, in] for projections)."""
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise GGUFError("%s: tensor %s has type %s, not supported (supported: %s)"
                            % (path, t.name, kind, ", ".join(SUPPORTED_TYPES)))
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise GGUFError("%s: cannot read tensor %s (%s): %s" % (path, t.name, kind, e)) from None
        shape = tuple(int(x) for x in reversed(t.shape))     # ggml lists the fastest axis first
        out[t.name] = np.ascontiguousarray(np.asarray(w, dtype=F32).reshape(shape))
    return out


def decoder_kwargs_from_gguf(path):
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    w = load_tensors(reader, path)

    def get(name):
        if name not in w:
            raise GGUFError("%s: tensor %s is missing" % (path, name))
        return w[name]

    layers = []
    for i in range(cfg.n_layers):
        p = "blk.%d." % i
        a = AttentionWeights(get(p + "attn_q.weight").T, get(p + "attn_k.weight").T, get(p + "attn_v.weight").T,
                             get(p + "attn_output.weight").T, w.get(p + "attn_q.bias"), w.get(p + "attn_k.bias"),
                             w.get(p + "attn_v.bias"))
        f = FFNWeights(get(p + "ffn_gate.weight").T, get(p + "ffn_down.weight").T, get(p + "ffn_up.weight").T)
        layers.append(LayerWeights(a, f, NormWeights(get(p + "attn_norm.weight")), NormWeights(get(p + "ffn_norm.weight"))))
    embed = get("token_embd.weight")
    if embed.shape != (cfg.vocab_size, cfg.d_model):
        raise GGUFError("%s: token_embd.weight is %s, expected %s" % (path, embed.shape, (cfg.vocab_size, cfg.d_model)))
    head = w["output.weight"].T if "output.weight" in w else embed.T   # tied embeddings
    return dict(cfg=cfg, embed=embed, layers=layers, final_norm=NormWeights(get("output_norm.weight")),
                lm_head=np.ascontiguousarray(head)), reader


__all__ = ["GGUFError", "open_gguf", "config_from_gguf", "load_tensors", "decoder_kwargs_from_gguf", "KVSimdValueError"]
