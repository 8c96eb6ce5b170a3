"""Import weights and configuration from loaded Hugging Face ``transformers`` models.

Supported: Llama and the families built like it (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2: GQA, gated
FFN, RMSNorm, NeoX RoPE, and the options each adds: see :func:`_llama`), GPT-NeoX (partial rotary,
parallel residual), GPT-2 (learned positions), BLOOM (ALiBi), BART and Marian (encoder-decoder;
learned / sinusoidal positions); RoPE scaling linear, llama3 or yarn.  torch is only touched to
read tensors; it is never a runtime dependency of kvsimd.

RoPE pairing: transformers stores Q/K rows for NeoX-style ``rotate_half``, and kvsimd keeps
that layout and rotates with ``style="neox"`` (GGUF files permute the rows for GPT-J-style
interleaved pairs and are rotated with ``style="gptj"``): q.k is the same either way.
"""
from __future__ import annotations

import math

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import F32, ROPE_SCALING, ModelConfig
from kvsimd.nn.weights import AttentionWeights, FFNWeights, LayerWeights, NormWeights, need_format, store_weights

_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
         "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _act(name):
    if name not in _ACTS:
        raise KVSimdValueError("activation %r is not supported (supported: %s)" % (name, ", ".join(sorted(_ACTS))))
    return _ACTS[name]


def _need_model(model, what):
    if not hasattr(model, "config") or not callable(getattr(model, "state_dict", None)):
        raise KVSimdTypeError("%s needs a loaded transformers model, got %s" % (what, type(model).__name__))


class _SD:
    """state_dict access as float32 NumPy arrays."""

    def __init__(self, model):
        self.sd = model.state_dict()

    def __call__(self, key, t=False):
        if key not in self.sd:
            raise KVSimdValueError("the model has no weight %r (an unsupported variant of its family?)" % key)
        x = self.sd[key].detach().float().cpu().numpy()
        return np.ascontiguousarray(x.T if t else x, dtype=F32)

    def opt(self, key, t=False):
        return self(key, t) if key in self.sd else None

    def has(self, key):
        return key in self.sd


def _first_set(*values):
    """The first value that is not None (a field present as None, as transformers may write it,
    means its default, as a missing one does; 0 is a value, to be checked as one)."""
    return next(v for v in values if v is not None)


def _real_field(v, name):
    """A config field that must be a real number, as a float (the boundary's one rule, named as the
    config's field)."""
    return _kvsimd._need_real(v, "config." + name)


def _query_pre_attn_scale(c):
    """Gemma 2's attention scale, query_pre_attn_scalar ** -0.5: the scalar must be a number > 0."""
    v = _real_field(c.query_pre_attn_scalar, "query_pre_attn_scalar")
    if not (math.isfinite(v) and v > 0):
        raise KVSimdValueError("config.query_pre_attn_scalar must be a finite number > 0, got %r" % v)
    return v ** -0.5


def _rope_params(cfg):
    """(theta, partial rotary fraction, ModelConfig.rope_scaling) of a transformers config: its
    ``rope_parameters`` (transformers 5.x) or ``rope_scaling`` (4.x, theta beside it).  RoPE
    types other than default, linear, llama3 and yarn are refused."""
    p = dict(getattr(cfg, "rope_scaling", None) or {})
    p.update(getattr(cfg, "rope_parameters", None) or {})
    theta = _first_set(p.get("rope_theta"), getattr(cfg, "rope_theta", None), getattr(cfg, "rotary_emb_base", None),
                       10000.0)
    frac = _first_set(p.get("partial_rotary_factor"), getattr(cfg, "partial_rotary_factor", None),
                      getattr(cfg, "rotary_pct", None), 1.0)
    theta, frac = _real_field(theta, "rope_theta"), _real_field(frac, "partial_rotary_factor")
    rtype = p.get("rope_type") or p.get("type") or "default"
    if rtype == "default":
        return theta, frac, None
    supported = [t for t in ROPE_SCALING if t != "default"]
    if rtype not in supported:
        raise KVSimdValueError("RoPE scaling %r is not supported (supported: default, %s)" % (rtype, ", ".join(supported)))
    required, optional = ROPE_SCALING[rtype]
    # transformers' own defaults: a missing original length is max_position_embeddings, a
    # missing yarn factor the ratio of the two, a zero beta the paper's value
    scaling = {"type": rtype}
    scaling.update((k, p[k]) for k in required + optional if p.get(k) is not None)
    if rtype == "yarn":
        for k in ("beta_fast", "beta_slow"):
            if k in scaling and not scaling[k]:
                del scaling[k]
    if "original_max_position_embeddings" in required and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = (getattr(cfg, "original_max_position_embeddings", None)
                                                       or cfg.max_position_embeddings)
    if rtype == "yarn" and "factor" not in scaling:
        scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(theta), float(frac), scaling


def _rotary_dim(Dh, frac):
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 < frac <= 1:
        raise KVSimdValueError("partial_rotary_factor must be a number in (0, 1], got %r" % (frac,))
    rd = int(Dh * frac)
    if rd % 2 or rd <= 0:
        raise KVSimdValueError("rotary dims = int(head_dim %d * %g) = %d: must be even and positive" % (Dh, frac, rd))
    return rd


def rope_spec(cfg, head_dim):
    """The RopeSpec of a transformers config (NeoX pairing, scaled frequencies and attention
    factor): what the transformers integration needs to turn a query transformers rotated."""
    from types import SimpleNamespace

    from kvsimd.cache import RopeSpec
    from kvsimd.nn.config import rope_frequencies
    theta, frac, scaling = _rope_params(cfg)
    rd = _rotary_dim(head_dim, frac)
    inv, att = rope_frequencies(SimpleNamespace(position="rope", rope_scaling=scaling, rotary_dim=rd,
                                                rope_theta=theta))
    return RopeSpec(theta, "neox", rd, head_dim, inv, att)


def _split_fused_heads(w, b, H, Dh):
    """GPT-NeoX/BLOOM fused qkv: output rows ordered [head][q|k|v][Dh] -> q, k, v (transposed)."""
    d_in = w.shape[1]
    w = w.reshape(H, 3, Dh, d_in)
    parts = [np.ascontiguousarray(w[:, i].reshape(H * Dh, d_in).T) for i in range(3)]
    bparts = [None] * 3 if b is None else [np.ascontiguousarray(b.reshape(H, 3, Dh)[:, i].reshape(-1)) for i in range(3)]
    return parts, bparts


def decoder_from_transformers(cls, model, weights="float32"):
    _need_model(model, "Decoder.from_transformers")
    need_format(weights)
    family = getattr(model.config, "model_type", type(model).__name__)
    builders = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama, "phi3": _llama,
                "gemma2": _llama, "gpt_neox": _neox, "gpt2": _gpt2, "bloom": _bloom}
    if not isinstance(family, str) or family not in builders:
        raise KVSimdValueError("Decoder.from_transformers: model family %r is not supported (supported: %s)"
                               % (family, ", ".join(sorted(builders))))
    return store_weights(cls(**builders[family](model)), weights)


def _windows(c):
    """Per-layer attention windows of a config (0: every key), or None: ``layer_types`` where the
    config has them (Gemma 2, Qwen2/3), else ``sliding_window`` on every layer (Mistral, Phi-3)."""
    n, W = c.num_hidden_layers, getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types is not None:
        if isinstance(types, (str, bytes)) or not all(isinstance(t, str) for t in types) or len(types) != n:
            raise KVSimdValueError("layer_types must be a list of %d strings (full_attention / sliding_attention), "
                                   "got %r" % (n, types))
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise KVSimdValueError("layer types %s are not supported (supported: full_attention, sliding_attention)"
                                   % ", ".join(map(repr, unknown)))
        if "sliding_attention" not in types:
            return None
        if not W:
            raise KVSimdValueError("the config has sliding_attention layers but sliding_window=%r" % (W,))
        return tuple(int(W) if t == "sliding_attention" else 0 for t in types)
    return (int(W),) * n if W else None


def _llama(model):
    """Llama-style decoders (RMSNorm, gated FFN, RoPE) and the options their families add:
    Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused qkv and gate|up projections and partial
    rotary dimension, Gemma 2's (1 + w) norms, norms after attention and FFN, scaled embeddings,
    score and logit caps, query scale and sliding-window layers."""
    c, sd = model.config, _SD(model)
    H, Hkv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    Dh = getattr(c, "head_dim", None) or c.hidden_size // H
    theta, frac, scaling = _rope_params(c)
    gemma = c.model_type == "gemma2"
    act = getattr(c, "hidden_activation", None) if gemma else None
    qk_norm = sd.has("model.layers.0.self_attn.q_norm.weight")
    cfg = ModelConfig(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=H,
                      n_kv_heads=Hkv, head_dim=Dh, ffn_dim=c.intermediate_size, activation=_act(act or c.hidden_act),
                      ffn_gated=True, norm="rmsnorm", norm_eps=c.rms_norm_eps, position="rope", rope_theta=theta,
                      rope_style="neox", rotary_dim=_rotary_dim(Dh, frac), rope_scaling=scaling,
                      max_positions=c.max_position_embeddings, bos_token_id=c.bos_token_id,
                      eos_token_id=c.eos_token_id if isinstance(c.eos_token_id, int) else None,
                      qk_norm=qk_norm, post_norms=gemma, embed_scale=math.sqrt(c.hidden_size) if gemma else 1.0,
                      attn_scale=_query_pre_attn_scale(c) if gemma else None,
                      attn_softcap=(getattr(c, "attn_logit_softcapping", None) or 0.0) if gemma else 0.0,
                      final_softcap=(getattr(c, "final_logit_softcapping", None) or 0.0) if gemma else 0.0,
                      attn_windows=_windows(c), family=c.model_type)
    q, kv, F = H * Dh, Hkv * Dh, c.intermediate_size

    def norm(key):        # Gemma's norms multiply by (1 + w), in float32 as transformers does
        w = sd(key)
        return NormWeights(w + np.float32(1.0) if gemma else w)

    layers = []
    for i in range(c.num_hidden_layers):
        p = "model.layers.%d." % i
        if sd.has(p + "self_attn.qkv_proj.weight"):      # Phi-3: rows q | k | v
            w = sd(p + "self_attn.qkv_proj.weight")
            wq, wk, wv = (np.ascontiguousarray(w[a:b].T) for a, b in ((0, q), (q, q + kv), (q + kv, q + 2 * kv)))
        else:
            wq, wk, wv = (sd(p + "self_attn.%s_proj.weight" % x, True) for x in "qkv")
        a = AttentionWeights(wq, wk, wv, sd(p + "self_attn.o_proj.weight", True),
                             sd.opt(p + "self_attn.q_proj.bias"), sd.opt(p + "self_attn.k_proj.bias"),
                             sd.opt(p + "self_attn.v_proj.bias"), sd.opt(p + "self_attn.o_proj.bias"))
        if sd.has(p + "mlp.gate_up_proj.weight"):        # Phi-3: rows gate | up
            w = sd(p + "mlp.gate_up_proj.weight")
            gate, up = np.ascontiguousarray(w[:F].T), np.ascontiguousarray(w[F:].T)
        else:
            gate, up = sd(p + "mlp.gate_proj.weight", True), sd(p + "mlp.up_proj.weight", True)
        f = FFNWeights(gate, sd(p + "mlp.down_proj.weight", True), up)
        extra = {}
        if qk_norm:
            extra.update(q_norm=norm(p + "self_attn.q_norm.weight"), k_norm=norm(p + "self_attn.k_norm.weight"))
        if gemma:
            extra.update(post_norm1=norm(p + "post_attention_layernorm.weight"),
                         post_norm2=norm(p + "post_feedforward_layernorm.weight"))
        layers.append(LayerWeights(a, f, norm(p + "input_layernorm.weight"),
                                   norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                                        + ".weight"), **extra))
    return dict(cfg=cfg, embed=sd("model.embed_tokens.weight"), layers=layers,
                final_norm=norm("model.norm.weight"), lm_head=sd("lm_head.weight", True))


def _neox(model):
    c, sd = model.config, _SD(model)
    H, d = c.num_attention_heads, c.hidden_size
    Dh = d // H
    theta, frac, scaling = _rope_params(c)
    cfg = ModelConfig(vocab_size=c.vocab_size, d_model=d, n_layers=c.num_hidden_layers, n_heads=H, n_kv_heads=H,
                      head_dim=Dh, ffn_dim=c.intermediate_size, activation=_act(c.hidden_act), norm="layernorm",
                      norm_eps=c.layer_norm_eps, parallel_residual=c.use_parallel_residual, position="rope",
                      rope_theta=theta, rope_style="neox", rotary_dim=_rotary_dim(Dh, frac), rope_scaling=scaling,
                      max_positions=c.max_position_embeddings, bos_token_id=c.bos_token_id,
                      eos_token_id=c.eos_token_id, family="gpt_neox")
    layers = []
    for i in range(c.num_hidden_layers):
        p = "gpt_neox.layers.%d." % i
        (wq, wk, wv), (bq, bk, bv) = _split_fused_heads(sd(p + "attention.query_key_value.weight"),
                                                        sd.opt(p + "attention.query_key_value.bias"), H, Dh)
        a = AttentionWeights(wq, wk, wv, sd(p + "attention.dense.weight", True), bq, bk, bv,
                             sd.opt(p + "attention.dense.bias"))
        f = FFNWeights(sd(p + "mlp.dense_h_to_4h.weight", True), sd(p + "mlp.dense_4h_to_h.weight", True), None,
                       sd.opt(p + "mlp.dense_h_to_4h.bias"), sd.opt(p + "mlp.dense_4h_to_h.bias"))
        layers.append(LayerWeights(a, f, NormWeights(sd(p + "input_layernorm.weight"), sd(p + "input_layernorm.bias")),
                                   NormWeights(sd(p + "post_attention_layernorm.weight"),
                                               sd(p + "post_attention_layernorm.bias"))))
    head = "embed_out.weight" if sd.has("embed_out.weight") else "lm_head.weight"
    return dict(cfg=cfg, embed=sd("gpt_neox.embed_in.weight"), layers=layers,
                final_norm=NormWeights(sd("gpt_neox.final_layer_norm.weight"), sd("gpt_neox.final_layer_norm.bias")),
                lm_head=sd(head, True))


def _gpt2(model):
    c, sd = model.config, _SD(model)
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(c, "reorder_and_upcast_attn", False) or \
            not getattr(c, "scale_attn_weights", True):
        raise KVSimdValueError("GPT-2 attention-scaling variants are not supported")
    H, d = c.n_head, c.n_embd
    Dh = d // H
    cfg = ModelConfig(vocab_size=c.vocab_size, d_model=d, n_layers=c.n_layer, n_heads=H, n_kv_heads=H, head_dim=Dh,
                      ffn_dim=c.n_inner or 4 * d, activation=_act(c.activation_function), norm="layernorm",
                      norm_eps=c.layer_norm_epsilon, position="learned", max_positions=c.n_positions,
                      bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, family="gpt2")
    layers = []
    for i in range(c.n_layer):
        p = "transformer.h.%d." % i
        w, b = sd(p + "attn.c_attn.weight"), sd(p + "attn.c_attn.bias")   # Conv1D: already [in, out]
        a = AttentionWeights(w[:, :d], w[:, d:2 * d], w[:, 2 * d:], sd(p + "attn.c_proj.weight"),
                             b[:d], b[d:2 * d], b[2 * d:], sd(p + "attn.c_proj.bias"))
        f = FFNWeights(sd(p + "mlp.c_fc.weight"), sd(p + "mlp.c_proj.weight"), None, sd(p + "mlp.c_fc.bias"),
                       sd(p + "mlp.c_proj.bias"))
        layers.append(LayerWeights(a, f, NormWeights(sd(p + "ln_1.weight"), sd(p + "ln_1.bias")),
                                   NormWeights(sd(p + "ln_2.weight"), sd(p + "ln_2.bias"))))
    return dict(cfg=cfg, embed=sd("transformer.wte.weight"), layers=layers, pos_embed=sd("transformer.wpe.weight"),
                final_norm=NormWeights(sd("transformer.ln_f.weight"), sd("transformer.ln_f.bias")),
                lm_head=sd("lm_head.weight", True))


def _bloom(model):
    c, sd = model.config, _SD(model)
    if getattr(c, "apply_residual_connection_post_layernorm", False):
        raise KVSimdValueError("BLOOM with apply_residual_connection_post_layernorm is not supported")
    H, d = c.n_head, c.hidden_size
    Dh = d // H
    cfg = ModelConfig(vocab_size=c.vocab_size, d_model=d, n_layers=c.n_layer, n_heads=H, n_kv_heads=H, head_dim=Dh,
                      ffn_dim=4 * d, activation="gelu_tanh", norm="layernorm", norm_eps=c.layer_norm_epsilon,
                      position="alibi", embed_norm=True, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                      family="bloom")
    layers = []
    for i in range(c.n_layer):
        p = "transformer.h.%d." % i
        (wq, wk, wv), (bq, bk, bv) = _split_fused_heads(sd(p + "self_attention.query_key_value.weight"),
                                                        sd(p + "self_attention.query_key_value.bias"), H, Dh)
        a = AttentionWeights(wq, wk, wv, sd(p + "self_attention.dense.weight", True), bq, bk, bv,
                             sd(p + "self_attention.dense.bias"))
        f = FFNWeights(sd(p + "mlp.dense_h_to_4h.weight", True), sd(p + "mlp.dense_4h_to_h.weight", True), None,
                       sd(p + "mlp.dense_h_to_4h.bias"), sd(p + "mlp.dense_4h_to_h.bias"))
        layers.append(LayerWeights(a, f, NormWeights(sd(p + "input_layernorm.weight"), sd(p + "input_layernorm.bias")),
                                   NormWeights(sd(p + "post_attention_layernorm.weight"),
                                               sd(p + "post_attention_layernorm.bias"))))
    return dict(cfg=cfg, embed=sd("transformer.word_embeddings.weight"), layers=layers,
                embed_norm=NormWeights(sd("transformer.word_embeddings_layernorm.weight"),
                                       sd("transformer.word_embeddings_layernorm.bias")),
                final_norm=NormWeights(sd("transformer.ln_f.weight"), sd("transformer.ln_f.bias")),
                lm_head=sd("lm_head.weight", True))


def encoder_decoder_from_transformers(cls, model, weights="float32"):
    _need_model(model, "EncoderDecoder.from_transformers")
    need_format(weights)
    c = model.config
    family = getattr(c, "model_type", type(model).__name__)
    if family not in ("bart", "marian"):
        raise KVSimdValueError("EncoderDecoder.from_transformers: model family %r is not supported (supported: bart, "
                               "marian)" % family)
    if getattr(c, "normalize_before", False):
        raise KVSimdValueError("%s with normalize_before (pre-norm) is not supported" % family)
    sd = _SD(model)
    d, H, He = c.d_model, c.decoder_attention_heads, c.encoder_attention_heads
    act = _act(c.activation_function)
    bart = family == "bart"
    position = "learned" if bart else "sinusoidal"
    common = dict(vocab_size=c.vocab_size, d_model=d, activation=act, norm="layernorm", norm_eps=1e-5,
                  pre_norm=False, position=position, max_positions=c.max_position_embeddings,
                  position_offset=2 if bart else 0, embed_scale=math.sqrt(d) if c.scale_embedding else 1.0,
                  embed_norm=bart, final_norm=False, eos_token_id=c.eos_token_id,
                  decoder_start_token_id=c.decoder_start_token_id, bos_token_id=c.bos_token_id, family=family)
    # each stack's heads split d_model its own way (transformers: head_dim = d_model // heads)
    dec_cfg = ModelConfig(n_layers=c.decoder_layers, n_heads=H, n_kv_heads=H, head_dim=d // H,
                          ffn_dim=c.decoder_ffn_dim, cross_attention=True, **common)
    enc_cfg = ModelConfig(n_layers=c.encoder_layers, n_heads=He, n_kv_heads=He, head_dim=d // He,
                          ffn_dim=c.encoder_ffn_dim, **common)

    def attn(p):
        return AttentionWeights(sd(p + "q_proj.weight", True), sd(p + "k_proj.weight", True),
                                sd(p + "v_proj.weight", True), sd(p + "out_proj.weight", True),
                                sd(p + "q_proj.bias"), sd(p + "k_proj.bias"), sd(p + "v_proj.bias"),
                                sd(p + "out_proj.bias"))

    def ln(p):
        return NormWeights(sd(p + ".weight"), sd(p + ".bias"))

    def layers(which, n, cross):
        out = []
        for i in range(n):
            p = "model.%s.layers.%d." % (which, i)
            f = FFNWeights(sd(p + "fc1.weight", True), sd(p + "fc2.weight", True), None, sd(p + "fc1.bias"),
                           sd(p + "fc2.bias"))
            out.append(LayerWeights(attn(p + "self_attn."), f, ln(p + "self_attn_layer_norm"), ln(p + "final_layer_norm"),
                                    attn(p + "encoder_attn.") if cross else None,
                                    ln(p + "encoder_attn_layer_norm") if cross else None))
        return out

    dec_embed = sd("model.decoder.embed_tokens.weight") if sd.has("model.decoder.embed_tokens.weight") else sd("model.shared.weight")
    enc_embed = sd("model.encoder.embed_tokens.weight") if sd.has("model.encoder.embed_tokens.weight") else sd("model.shared.weight")
    lm_head = sd("lm_head.weight", True) if sd.has("lm_head.weight") else np.ascontiguousarray(dec_embed.T)
    bias = sd.opt("final_logits_bias")
    m = cls(dec_cfg, enc_cfg,
            enc_embed_pos=sd("model.encoder.embed_positions.weight") if bart else None,
            enc_layers=layers("encoder", c.encoder_layers, False), enc_final_norm=None,
            enc_embed_norm=ln("model.encoder.layernorm_embedding") if bart else None,
            embed=dec_embed, layers=layers("decoder", c.decoder_layers, True), final_norm=None,
            lm_head=lm_head, lm_bias=None if bias is None else bias.reshape(-1),
            pos_embed=sd("model.decoder.embed_positions.weight") if bart else None,
            embed_norm=ln("model.decoder.layernorm_embedding") if bart else None)
    m.enc_embed = enc_embed
    return store_weights(m, weights)
