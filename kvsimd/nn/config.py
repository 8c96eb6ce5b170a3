"""The configuration of a transformer: what the forward pass needs to know about an architecture,
and the one check of it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

F32: type = np.float32

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "alibi", "learned", "sinusoidal")

# Every assignment to a weights object or a ModelConfig bumps this counter, so a model can tell
# cheaply (one integer compare per call) whether it must validate its weights again.
_generation = [0]


def weights_generation():
    """A counter that changes whenever any ModelConfig or weights object is assigned to."""
    return _generation[0]


class _Tracked:
    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        _generation[0] += 1


@dataclass
class ModelConfig(_Tracked):
    """Everything the forward pass needs to know about an architecture."""
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    activation: str = "silu"          # silu | gelu | gelu_tanh | relu  (gated: see ffn_gated)
    ffn_gated: bool = False           # SwiGLU-style: act(x W1) * (x W3)
    norm: str = "rmsnorm"             # rmsnorm | layernorm
    norm_eps: float = 1e-6
    pre_norm: bool = True             # False: post-norm (BART/Marian)
    parallel_residual: bool = False   # GPT-NeoX: x + attn(ln1 x) + ffn(ln2 x)
    position: str = "rope"            # rope | alibi | learned | sinusoidal
    rope_theta: float = 10000.0
    rope_style: str = "neox"          # pairing of the stored q/k layout
    rotary_dim: Optional[int] = None
    max_positions: int = 1 << 20
    position_offset: int = 0          # BART's learned positions start at row 2
    embed_scale: float = 1.0
    embed_norm: bool = False          # a norm right after the embeddings (BLOOM, BART)
    final_norm: bool = True
    cross_attention: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    decoder_start_token_id: Optional[int] = None
    # options of the families that need them (each general: any model may set them)
    qk_norm: bool = False             # a norm of each q and k head (head_dim wide) before RoPE (Qwen3)
    post_norms: bool = False          # norms of the attention and FFN outputs before their residual adds (Gemma 2)
    attn_scale: Optional[float] = None    # scores are attn_scale * q.k (None: 1 / sqrt(head_dim))
    attn_softcap: float = 0.0         # scores capped to c * tanh(s / c) before the softmax (0: off)
    final_softcap: float = 0.0        # logits capped likewise (0: off)
    attn_windows: Optional[tuple] = None  # per layer: its queries see their last W keys only (0: all keys)
    family: str = ""

    def __post_init__(self):
        if self.rotary_dim is None and isinstance(self.head_dim, (int, np.integer)):
            self.rotary_dim = self.head_dim
        check_config(self)


def _real(x, name):
    """``x`` as a float: a real number (bools are not) that fits a double, else a KVSimdError naming
    ``name`` (the boundary's one rule, kvsimd._kvsimd._need_real)."""
    return _kvsimd._need_real(x, name)


BOOL_FIELDS = ("ffn_gated", "pre_norm", "parallel_residual", "embed_norm", "final_norm", "cross_attention", "qk_norm",
               "post_norms")


def check_config(cfg, what="config"):
    """Every field the forward pass reads, checked once (at construction and whenever a model
    re-validates after an assignment)."""
    need_int = _kvsimd._need_int
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                 "max_positions"):
        v = need_int(getattr(cfg, name), "%s.%s" % (what, name))
        if v < 1:
            raise KVSimdValueError("%s.%s must be >= 1, got %d" % (what, name, v))
    if need_int(cfg.position_offset, what + ".position_offset") < 0:
        raise KVSimdValueError("%s.position_offset must be >= 0, got %d" % (what, cfg.position_offset))
    for name in BOOL_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, (bool, np.bool_)):
            raise KVSimdTypeError("%s.%s must be a bool, got %r" % (what, name, v))
    if cfg.parallel_residual and (not cfg.pre_norm or cfg.cross_attention):
        # one rule per layer: GPT-NeoX's x + attn(ln1 x) + ffn(ln2 x) is a pre-norm, self-attention-only layer
        raise KVSimdValueError("%s.parallel_residual needs pre_norm=True and cross_attention=False, got pre_norm=%r, "
                               "cross_attention=%r" % (what, cfg.pre_norm, cfg.cross_attention))
    if cfg.post_norms and not cfg.pre_norm:
        raise KVSimdValueError("%s.post_norms needs pre_norm=True (norms on both sides of each sublayer)" % what)
    if cfg.n_heads % cfg.n_kv_heads:
        raise KVSimdValueError("n_heads=%d must be a multiple of n_kv_heads=%d" % (cfg.n_heads, cfg.n_kv_heads))
    for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("position", POSITIONS)):
        if getattr(cfg, name) not in allowed:
            raise KVSimdValueError("%s.%s must be one of %s, got %r"
                                   % (what, name, ", ".join(allowed), getattr(cfg, name)))
    reals = (("norm_eps", 0.0), ("embed_scale", None), ("attn_softcap", 0.0), ("final_softcap", 0.0))
    if cfg.attn_scale is not None:
        reals += (("attn_scale", 0.0),)
    if cfg.position != "rope":        # with RoPE, theta follows the kernels' rule below
        reals += (("rope_theta", None),)
    for name, lo in reals:
        v = _real(getattr(cfg, name), "%s.%s" % (what, name))
        if not math.isfinite(v) or (lo is not None and v < lo):
            raise KVSimdValueError("%s.%s must be finite%s, got %r"
                                   % (what, name, "" if lo is None else " and >= 0", v))
    if cfg.attn_scale is not None and cfg.attn_scale == 0:
        raise KVSimdValueError("%s.attn_scale must be > 0 (or None), got 0" % what)
    check_windows(cfg, what)
    if cfg.position == "rope":
        # the kernels' own rule for theta, style and rotary_dim (ops.apply_rope, KVCache.step_plan),
        # so a config accepted here is never refused by every prefill
        need_int(cfg.rotary_dim, what + ".rotary_dim")
        try:
            _kvsimd._rope_params(cfg.rope_theta, cfg.rope_style, cfg.rotary_dim, cfg.head_dim)
        except KVSimdError as e:
            # the boundary's message, which starts with the argument's name, naming the config field
            arg, rest = re.match(r"(\w*)(.*)", str(e), re.S).groups()
            field = {"theta": "rope_theta", "style": "rope_style"}.get(arg, arg)
            raise type(e)("%s.%s%s" % (what, field, rest)) from None


def check_windows(cfg, what="config"):
    """``attn_windows``: None, or one integer >= 0 per layer (0: the layer sees every key)."""
    w = cfg.attn_windows
    if w is None:
        return
    if not isinstance(w, (tuple, list)) or len(w) != cfg.n_layers:
        raise KVSimdValueError("%s.attn_windows must be None or %d integers (one per layer), got %r"
                               % (what, cfg.n_layers, w))
    for i, x in enumerate(w):
        v = _kvsimd._need_int(x, "%s.attn_windows[%d]" % (what, i))
        if v < 0:
            raise KVSimdValueError("%s.attn_windows[%d] must be >= 0 (0: all keys), got %d" % (what, i, v))


def layer_windows(cfg):
    """The window of every layer (0: all keys)."""
    return tuple(int(x) for x in cfg.attn_windows) if cfg.attn_windows is not None else (0,) * cfg.n_layers


def attention_scale(cfg):
    """The factor of q.k in the scores."""
    return float(cfg.attn_scale) if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
