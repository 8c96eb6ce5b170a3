"""The configuration of a transformer: what the forward pass needs to know about an architecture,
and the one check of it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

F32: type = np.float32

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "alibi", "learned", "sinusoidal")
# RoPE scaling: type -> (required parameters, optional ones), under transformers' names; every
# type may also have "freq_factors" (rotary_dim/2 divisors of the frequencies: GGUF's rope_freqs).
ROPE_SCALING = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
}
_F32_MAX = float(np.finfo(np.float32).max)

_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": 0.0,
                  "mscale_all_dim": 0.0, "truncate": True}

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


class _ReadOnlyDict(dict):
    """ModelConfig.rope_scaling as stored: a copy that refuses in-place edits (a model re-validates
    when a config field is assigned, and would not see them)."""

    def _refuse(self, *args, **kw):
        raise KVSimdTypeError("ModelConfig.rope_scaling is read-only: assign a new dict")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return _ReadOnlyDict, (dict(self),)


def _frozen_scaling(value):
    if not isinstance(value, dict):
        return value          # None, or refused by check_config
    d = dict(value)
    ff = d.get("freq_factors")
    if isinstance(ff, np.ndarray):
        d["freq_factors"] = tuple(ff.tolist()) if ff.ndim == 1 else ff.tolist()
    elif isinstance(ff, list):
        d["freq_factors"] = tuple(ff)
    return _ReadOnlyDict(d)


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
    # None, or {"type": one of ROPE_SCALING, its parameters under transformers' names, optional
    # "freq_factors"}: see rope_frequencies.  Stored as a read-only copy.
    rope_scaling: Optional[Dict[str, Any]] = None

    def __setattr__(self, name, value):
        if name == "rope_scaling":
            value = _frozen_scaling(value)
        elif name == "attn_windows" and isinstance(value, list):   # a tuple: no edit in place goes unchecked
            value = tuple(value)
        super().__setattr__(name, value)

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
    reals = (("norm_eps", 0.0), ("embed_scale", None), ("final_softcap", 0.0))
    if cfg.attn_scale is not None:
        reals += (("attn_scale", 0.0),)
    if cfg.position != "rope":        # with RoPE, theta follows the kernels' rule below
        reals += (("rope_theta", None),)
    for name, lo in reals:
        v = _real(getattr(cfg, name), "%s.%s" % (what, name))
        if not math.isfinite(v) or (lo is not None and v < lo):
            raise KVSimdValueError("%s.%s must be finite%s, got %r"
                                   % (what, name, "" if lo is None else " and >= 0", v))
        # the passes use these as float32 (attn_scale has the kernels' own rule, _need_scale below)
        if name in ("norm_eps", "embed_scale", "final_softcap") and abs(v) > _F32_MAX:
            raise KVSimdValueError("%s.%s must be finite and within float32 range (|x| <= %.7g), got %r"
                                   % (what, name, _F32_MAX, v))
    try:      # the kernel's rule for the score cap (ops.attend, the plans), named as the config's field
        _kvsimd._need_softcap(cfg.attn_softcap)
    except KVSimdError as e:
        raise type(e)("%s.attn_%s" % (what, e)) from None
    if cfg.attn_scale is not None and cfg.attn_scale == 0:
        raise KVSimdValueError("%s.attn_scale must be > 0 (or None), got 0" % what)
    if cfg.attn_scale is not None:   # the kernels' rule for the scale (ops.attend, the plans)
        try:
            _kvsimd._need_scale(cfg.attn_scale, cfg.head_dim)
        except KVSimdError as e:
            raise type(e)("%s.attn_%s" % (what, e)) from None
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
        inv, att = rope_frequencies(cfg, what)
        if inv is not None:
            try:      # the kernels' rule for explicit frequencies and the attention factor
                _kvsimd.RopeSpec(cfg.rope_theta, cfg.rope_style, cfg.rotary_dim, cfg.head_dim, inv, att)
            except KVSimdError as e:
                raise type(e)("%s.rope_scaling gives RoPE the kernels refuse: %s" % (what, e)) from None
    elif cfg.rope_scaling is not None:
        raise KVSimdValueError("%s.rope_scaling applies to RoPE positions; position is %r" % (what, cfg.position))


def _scaling_params(cfg, what):
    """cfg.rope_scaling checked: None, or (type, parameters with the type's defaults, freq_factors
    as float64 [rotary_dim/2] or None); a bad one raises a KVSimdError naming the key."""
    sc = cfg.rope_scaling
    if sc is None:
        return None
    name = what + ".rope_scaling"
    if not isinstance(sc, dict):
        raise KVSimdTypeError("%s must be None or a dict, got %s" % (name, type(sc).__name__))
    kind = sc.get("type")
    if not isinstance(kind, str) or kind not in ROPE_SCALING:
        raise KVSimdValueError("%s['type'] must be one of %s, got %r" % (name, ", ".join(ROPE_SCALING), kind))
    required, optional = ROPE_SCALING[kind]
    allowed = ("type",) + required + optional + ("freq_factors",)
    unknown = sorted(str(k) for k in sc if k not in allowed)
    if unknown:
        raise KVSimdValueError("%s has unknown key %s for type %r (its keys: %s)"
                               % (name, ", ".join(map(repr, unknown)), kind, ", ".join(allowed)))
    missing = [k for k in required if k not in sc]
    if missing:
        raise KVSimdValueError("%s['%s'] is missing: type %r needs %s" % (name, missing[0], kind, ", ".join(required)))
    p = dict(_YARN_DEFAULTS) if kind == "yarn" else {}
    for k in required + optional:
        if k not in sc:
            continue
        v, key = sc[k], "%s['%s']" % (name, k)
        if k == "truncate":
            if not isinstance(v, (bool, np.bool_)):
                raise KVSimdTypeError("%s must be a bool, got %r" % (key, v))
            p[k] = bool(v)
        elif k == "original_max_position_embeddings":
            p[k] = _kvsimd._need_int(v, key, 1)
        else:
            x = _real(v, key)
            if k.startswith("mscale"):
                if not (math.isfinite(x) and x >= 0):
                    raise KVSimdValueError("%s must be finite and >= 0, got %r" % (key, x))
            elif not (math.isfinite(x) and x > 0):
                raise KVSimdValueError("%s must be finite and > 0, got %r" % (key, x))
            p[k] = x
    if kind == "llama3" and not p["high_freq_factor"] > p["low_freq_factor"]:
        raise KVSimdValueError("%s['high_freq_factor']=%r must be greater than low_freq_factor=%r"
                               % (name, p["high_freq_factor"], p["low_freq_factor"]))
    if kind == "yarn" and _real(cfg.rope_theta, what + ".rope_theta") == 1.0:
        raise KVSimdValueError("%s.rope_theta=1 is refused with yarn scaling (its correction range divides by "
                               "log(theta))" % what)
    ff = sc.get("freq_factors")
    if ff is not None:
        key, R = name + "['freq_factors']", cfg.rotary_dim // 2
        if isinstance(ff, np.ma.MaskedArray):
            raise KVSimdTypeError("%s is a numpy.ma.MaskedArray: kvsimd would ignore its mask" % key)
        if isinstance(ff, (str, bytes)) or not isinstance(ff, (list, tuple, np.ndarray)):
            raise KVSimdTypeError("%s must be a sequence of rotary_dim/2=%d reals, got %s"
                                  % (key, R, type(ff).__name__))
        try:
            a = np.array(ff)
        except (TypeError, ValueError):
            raise KVSimdTypeError("%s must be a 1-D sequence of reals, got %r" % (key, ff)) from None
        if a.dtype.kind not in "iuf":
            raise KVSimdTypeError("%s must hold real numbers, got dtype %s" % (key, a.dtype))
        if a.shape != (R,):
            raise KVSimdValueError("%s must have rotary_dim/2=%d entries, got shape %s" % (key, R, a.shape))
        ff = a.astype(np.float64)
        bad = ~(np.isfinite(ff) & (ff > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise KVSimdValueError("%s[%d]=%r must be finite and > 0" % (key, i, float(ff[i])))
    return kind, p, ff


def _yarn_mscale(factor, m=1.0):
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def rope_frequencies(cfg, what="config"):
    """RoPE's inverse frequencies and attention factor under ``cfg.rope_scaling``: (float64
    [rotary_dim/2], float), or (None, 1.0) without scaling (the kernels then use
    ``theta ** (-2i / rotary_dim)``).  The one place of the scaling formulas, with d = rotary_dim,
    f = factor and base[i] = theta ** (-2i / d):

    - default: base (only freq_factors change it);
    - linear (position interpolation): base / f, the same as positions / f;
    - llama3 (Llama 3.1): wavelengths 2 pi / base[i] below original_max_position_embeddings /
      high_freq_factor keep base, above original / low_freq_factor take base / f, in between
      s = (original / wavelength - low) / (high - low) mixes them: (1 - s) base / f + s base;
    - yarn (YaRN, arXiv:2309.00071): pair i is base / f (interpolated) or base (extrapolated) by
      a ramp over the pairs between the dimensions where the original context turns beta_fast
      and beta_slow times (floor/ceil of them with truncate); attention factor
      ``attention_factor``, else 0.1 ln f + 1 (with mscale and mscale_all_dim their ratio).

    freq_factors (GGUF's rope_freqs) then divide the frequencies, whatever the type."""
    if cfg.position != "rope":
        return None, 1.0
    sp = _scaling_params(cfg, what)
    if sp is None:
        return None, 1.0
    kind, p, ff = sp
    d, theta, att = cfg.rotary_dim, _real(cfg.rope_theta, what + ".rope_theta"), 1.0
    base = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    inv = base
    if kind == "linear":
        inv = base / p["factor"]
    elif kind == "llama3":
        f, lo, hi, orig = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / base
        s = (orig / wavelen - lo) / (hi - lo)
        inv = np.where(wavelen < orig / hi, base, np.where(wavelen > orig / lo, base / f, (1 - s) * base / f + s * base))
    elif kind == "yarn":
        f, orig = p["factor"], p["original_max_position_embeddings"]

        def pair_turning(turns):     # the (fractional) dimension whose wavelength is orig / turns
            return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = pair_turning(p["beta_fast"]), pair_turning(p["beta_slow"])
        if p["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        inv = base / f * ramp + base * (1.0 - ramp)
        if p["attention_factor"] is not None:
            att = p["attention_factor"]
        elif p["mscale"] and p["mscale_all_dim"]:
            att = _yarn_mscale(f, p["mscale"]) / _yarn_mscale(f, p["mscale_all_dim"])
        else:
            att = _yarn_mscale(f)
    if ff is not None:
        inv = inv / ff
    return np.ascontiguousarray(inv, dtype=np.float64), float(att)


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
