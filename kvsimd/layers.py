"""Transformer building blocks over NumPy float32 arrays.

Linear layers are BLAS matrix products through NumPy (weights stored as ``[in, out]`` so a
row of activations multiplies directly); attention over cached K/V runs in kvsimd's kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvsimd import ops
from kvsimd.errors import KVSimdValueError

F32 = np.float32


# ------------------------------------------------------------------------------ config
@dataclass
class ModelConfig:
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
    family: str = ""

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise KVSimdValueError("n_heads=%d must be a multiple of n_kv_heads=%d" % (self.n_heads, self.n_kv_heads))
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim


# ------------------------------------------------------------------------------ functions
try:  # SciPy's erf when it is installed (resolved once: a failed import per call is slow)
    from scipy.special import erf as _scipy_erf
except ImportError:
    _scipy_erf = None


def _erf(x):
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26 is 1.5e-7); float32-adequate."""
    if _scipy_erf is not None:
        return _scipy_erf(x)
    s = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-a * a)
    return (s * y).astype(x.dtype)


def activation(name, x):
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if name == "relu":
        return np.maximum(x, 0)
    raise KVSimdValueError("unknown activation %r" % name)


def norm(cfg, x, w, b):
    # ufunc reductions directly (np.mean's Python layer costs more than the math at decode sizes)
    inv_n = x.dtype.type(1.0 / x.shape[-1])
    eps = x.dtype.type(cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        r = np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) * inv_n + eps)
        y = x / r
        y *= w
        return y
    xc = x - np.add.reduce(x, axis=-1, keepdims=True) * inv_n
    r = np.sqrt(np.add.reduce(xc * xc, axis=-1, keepdims=True) * inv_n + eps)
    xc /= r
    xc *= w
    if b is not None:
        xc += b
    return xc


def linear(x, w, b=None):
    y = x @ w
    return y + b if b is not None else y


def alibi_slopes(n_heads):
    """ALiBi head slopes (Press et al.), as BLOOM builds them for any head count."""
    p = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(p) - 3)))
    slopes = [base ** (i + 1) for i in range(p)]
    if p < n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - p)]
    return np.array(slopes, dtype=F32)


def sinusoidal_table(n_positions, dim):
    """Sinusoidal positions: sin in the first half of the dims, cos in the second (Marian)."""
    half = dim // 2
    inv = np.power(10000.0, -np.arange(half, dtype=np.float64) * 2.0 / dim)
    ang = np.arange(n_positions, dtype=np.float64)[:, None] * inv[None, :]
    table = np.zeros((n_positions, dim), dtype=np.float64)
    table[:, :half] = np.sin(ang)
    table[:, half:2 * half] = np.cos(ang)
    return table.astype(F32)


def causal_attention(q, k, v, q_start, slopes=None, causal=True):
    """Attention of queries ``q [H, T, D]`` at positions ``q_start..q_start+T-1`` over keys
    ``k, v [Hkv, S, D]`` at positions ``0..S-1`` (float32 math; GQA by head groups).
    Used for prefill and for encoders; decode steps use the cache kernel."""
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    G = H // Hkv
    qg = q.reshape(Hkv, G * T, D)
    s = np.matmul(qg, np.swapaxes(k, 1, 2)).reshape(H, T, S) * (1.0 / math.sqrt(D))
    qpos = np.arange(q_start, q_start + T)[:, None]
    kpos = np.arange(S)[None, :]
    if slopes is not None:
        s = s - slopes[:, None, None] * (qpos - kpos)[None].astype(F32)
    if causal:
        s = np.where((kpos > qpos)[None], -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p.reshape(Hkv, G * T, S), v).reshape(H, T, D).astype(F32)


# ------------------------------------------------------------------------------ weights
@dataclass
class AttentionWeights:
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: Optional[np.ndarray] = None
    bk: Optional[np.ndarray] = None
    bv: Optional[np.ndarray] = None
    bo: Optional[np.ndarray] = None
    wqkv: np.ndarray = field(init=False, repr=False)
    bqkv: Optional[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"):
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, np.ascontiguousarray(a, dtype=F32))
        # one matrix product for q, k and v
        self.wqkv = np.ascontiguousarray(np.concatenate([self.wq, self.wk, self.wv], axis=1))
        if self.bq is None and self.bk is None and self.bv is None:
            self.bqkv = None
        else:
            z = lambda b, n: b if b is not None else np.zeros(n, F32)  # noqa: E731
            self.bqkv = np.concatenate([z(self.bq, self.wq.shape[1]), z(self.bk, self.wk.shape[1]),
                                        z(self.bv, self.wv.shape[1])])


@dataclass
class FFNWeights:
    w1: np.ndarray
    w2: np.ndarray
    w3: Optional[np.ndarray] = None   # gate partner (gated FFN)
    b1: Optional[np.ndarray] = None
    b2: Optional[np.ndarray] = None
    w13: Optional[np.ndarray] = field(init=False, repr=False, default=None)

    def __post_init__(self):
        for name in ("w1", "w2", "w3", "b1", "b2"):
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, np.ascontiguousarray(a, dtype=F32))
        if self.w3 is not None:
            self.w13 = np.ascontiguousarray(np.concatenate([self.w1, self.w3], axis=1))


@dataclass
class NormWeights:
    w: np.ndarray
    b: Optional[np.ndarray] = None

    def __post_init__(self):
        self.w = np.ascontiguousarray(self.w, dtype=F32)
        if self.b is not None:
            self.b = np.ascontiguousarray(self.b, dtype=F32)


@dataclass
class LayerWeights:
    attn: AttentionWeights
    ffn: FFNWeights
    norm1: NormWeights                  # before (pre-norm) / after (post-norm) self-attention
    norm2: NormWeights                  # FFN
    cross: Optional[AttentionWeights] = None
    norm_cross: Optional[NormWeights] = None


def ffn(cfg, f: FFNWeights, x):
    if f.w13 is not None:
        h = x @ f.w13
        n = f.w1.shape[1]
        h = activation(cfg.activation, h[..., :n]) * h[..., n:]
    else:
        h = activation(cfg.activation, linear(x, f.w1, f.b1))
    return linear(h, f.w2, f.b2)


def split_heads(x, n_heads, head_dim):
    """[T, n_heads * head_dim] -> C-contiguous [n_heads, T, head_dim]"""
    T = x.shape[0]
    return np.ascontiguousarray(x.reshape(T, n_heads, head_dim).transpose(1, 0, 2))


def merge_heads(x):
    """[n_heads, T, head_dim] -> [T, n_heads * head_dim]"""
    H, T, D = x.shape
    return x.transpose(1, 0, 2).reshape(T, H * D)


def rope(cfg, x, positions):
    if cfg.position == "rope":
        ops.apply_rope(x, positions, theta=cfg.rope_theta, style=cfg.rope_style, rotary_dim=cfg.rotary_dim)
    return x
