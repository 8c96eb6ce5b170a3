"""A model's weights: the dataclasses a loader fills, their checks against a ModelConfig, and their
packing into the compiled layers (``pack_layers``).

A matrix is either a float32 array ``[in, out]`` or a weight kept as its file stores it, a
:class:`kvsimd.QMatrix` ``[out, in]`` (GGUF / torch order; quantized or 16-bit): loaders keep
GGUF tensors so, and the compiled layers multiply them in place.  Fused projections (q|k|v,
gate|up) of QMatrix parts are tuples of the parts, never copies; of float32 parts, copies, which
the decoder multiplies: the parts (the model's own copies) and the fused copies are read-only, so
that an edit is made by assigning a new array (which re-fuses), never lost in place."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvsimd import _kvsimd
from kvsimd.errors import KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import F32, _Tracked, layer_windows


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


# ------------------------------------------------------------------------------ weights
QMatrix = _kvsimd.QMatrix


def _out_dim(w):
    return w.rows if isinstance(w, QMatrix) else w.shape[-1]


def embed_rows(table, ids):
    """Rows ``ids`` of an embedding table (a float32 array, or a QMatrix dequantized row by row)."""
    return table.take(ids) if isinstance(table, QMatrix) else table[ids]


def _f32(a, name):
    """``a`` as a C-contiguous float32 array (weights are converted once, at construction); a
    QMatrix stays as it is stored."""
    if isinstance(a, QMatrix):
        return a
    if a is None:
        raise KVSimdTypeError("%s must be an array of real numbers, got None" % name)
    try:
        return np.ascontiguousarray(a, dtype=F32)
    except (TypeError, ValueError) as e:
        raise KVSimdTypeError("%s must be an array of real numbers, got %s: %s"
                              % (name, type(a).__name__, e)) from None


def _fuse_columns(parts, what):
    """Concatenate 2-D ``[in, out_i]`` matrices (or 1-D biases) along their last axis; QMatrix
    parts are kept apart, as a tuple (each multiplies into its own columns)."""
    if any(isinstance(p, QMatrix) for p in parts):
        if not all(isinstance(p, QMatrix) for p in parts):
            raise KVSimdTypeError("%s: a fused projection takes float32 arrays or QMatrix weights, not a mix "
                                  "(got %s)" % (what, ", ".join(type(p).__name__ for p in parts)))
        if len({p.cols for p in parts}) != 1:
            raise KVSimdValueError("%s: the parts must have the same inputs, got %s" % (what, list(parts)))
        return tuple(parts)
    shapes = [getattr(p, "shape", None) for p in parts]
    if any(sh is None or len(sh) != len(shapes[0]) or sh[:-1] != shapes[0][:-1] for sh in shapes):
        raise KVSimdValueError("%s: the parts must agree in all but their last dimension, got shapes %s"
                               % (what, ", ".join(str(sh) for sh in shapes)))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def _freeze_parts(obj, names, fused):
    """The float32 parts ``names`` of ``obj`` as read-only arrays of the model's own, and the
    ``fused`` matrices made of them read-only: the decoder multiplies the fused copy, so an in-place
    edit of a part would be silently lost -- it is refused instead (assigning a new array
    re-fuses).  A part is copied (once: a frozen copy stays) rather than frozen in place, so that a
    caller's array is never made read-only, and a part read by pointer (cross-attention's wq) is
    an array the compiled layers' checks see resized.  None and QMatrix parts stay as they are."""
    for name in names:
        part = getattr(obj, name)
        if isinstance(part, np.ndarray) and (part.flags.writeable or not part.flags.owndata):
            own = np.array(part)
            own.flags.writeable = False
            object.__setattr__(obj, name, own)
    for m in fused:
        if isinstance(m, np.ndarray):
            m.flags.writeable = False


def _convert_and_fuse(obj, names):
    """The arrays ``names`` of a weights dataclass as float32, then its fused matrices (once ready,
    assigning a part re-fuses them: see __setattr__)."""
    for name in names:
        a = getattr(obj, name)
        if a is not None:
            object.__setattr__(obj, name, _f32(a, name))
    obj._fuse()
    object.__setattr__(obj, "_ready", True)


@dataclass
class AttentionWeights(_Tracked):
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
    wkv: np.ndarray = field(init=False, repr=False)
    bkv: Optional[np.ndarray] = field(init=False, repr=False)

    _PARTS = ("wq", "wk", "wv", "bq", "bk", "bv")

    def __post_init__(self):
        _convert_and_fuse(self, ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"))

    def __setattr__(self, name, value):
        # assigning wq/wk/wv (or their biases) after construction re-fuses wqkv/bqkv, so the
        # fused matrices the decoder multiplies never go stale
        super().__setattr__(name, value)
        if name in self._PARTS and self.__dict__.get("_ready"):
            self._fuse()

    def _fuse(self):
        # one matrix product for q, k and v
        z = lambda b, w: b if b is not None else np.zeros(_out_dim(w), F32)  # noqa: E731
        self.wqkv = _fuse_columns([self.wq, self.wk, self.wv], "wq, wk, wv")
        if self.bq is None and self.bk is None and self.bv is None:
            self.bqkv = None
        else:
            self.bqkv = _fuse_columns([z(self.bq, self.wq), z(self.bk, self.wk), z(self.bv, self.wv)],
                                      "bq, bk, bv")
        # k and v alone (cross-attention projects the encoder output with them)
        self.wkv = _fuse_columns([self.wk, self.wv], "wk, wv")
        self.bkv = None if self.bk is None and self.bv is None else \
            _fuse_columns([z(self.bk, self.wk), z(self.bv, self.wv)], "bk, bv")
        _freeze_parts(self, self._PARTS, (self.wqkv, self.bqkv, self.wkv, self.bkv))


@dataclass
class FFNWeights(_Tracked):
    w1: np.ndarray
    w2: np.ndarray
    w3: Optional[np.ndarray] = None   # gate partner (gated FFN)
    b1: Optional[np.ndarray] = None
    b2: Optional[np.ndarray] = None
    w13: Optional[np.ndarray] = field(init=False, repr=False, default=None)

    def __post_init__(self):
        _convert_and_fuse(self, ("w1", "w2", "w3", "b1", "b2"))

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in ("w1", "w3") and self.__dict__.get("_ready"):
            self._fuse()

    def _fuse(self):
        self.w13 = None if self.w3 is None else _fuse_columns([self.w1, self.w3], "w1, w3")
        if self.w13 is not None:
            _freeze_parts(self, ("w1", "w3"), (self.w13,))


@dataclass
class NormWeights(_Tracked):
    w: np.ndarray
    b: Optional[np.ndarray] = None

    def __post_init__(self):
        self.w = _f32(self.w, "w")
        if self.b is not None:
            self.b = _f32(self.b, "b")


@dataclass
class LayerWeights(_Tracked):
    attn: AttentionWeights
    ffn: FFNWeights
    norm1: NormWeights                  # before (pre-norm) / after (post-norm) self-attention
    norm2: NormWeights                  # FFN
    cross: Optional[AttentionWeights] = None
    norm_cross: Optional[NormWeights] = None
    q_norm: Optional[NormWeights] = None    # of each q head, [head_dim] (cfg.qk_norm)
    k_norm: Optional[NormWeights] = None    # of each k head
    post_norm1: Optional[NormWeights] = None    # of the attention output (cfg.post_norms)
    post_norm2: Optional[NormWeights] = None    # of the FFN output


# ------------------------------------------------------------------------------ validation
def _need_stored(a, name, shape, table):
    """A QMatrix (or a fused tuple of them) standing for a matrix of ``shape``: ``[in, out]`` of a
    projection is stored ``[out, in]``; an embedding table (``table``) ``[rows, d]`` as it is."""
    parts = a if isinstance(a, tuple) else (a,)
    if len(shape) != 2 or not parts or not all(isinstance(p, QMatrix) for p in parts) or (table and len(parts) > 1):
        raise KVSimdTypeError("%s must be a float32 array of shape %s, got %r" % (name, shape, a))
    got = (parts[0].rows, parts[0].cols) if table else (parts[0].cols, sum(p.rows for p in parts))
    if any(want is not None and g != want for g, want in zip(got, shape)):
        raise KVSimdValueError("%s must have shape %s%s, got %r" % (
            name, str(shape).replace("None", "n >= 1"), "" if table else " ([in, out]; stored [out, in])", a))
    return a


def need_weight(a, name, shape, optional=False, table=False):
    """``a`` must be a float32, C-contiguous, aligned array of exactly ``shape`` (the compiled
    decode step reads weights by pointer with lengths taken from the ModelConfig), or a matrix
    kept as stored (QMatrix ``[out, in]``, or an embedding ``table`` ``[rows, d]``)."""
    if isinstance(a, (QMatrix, tuple)):
        return _need_stored(a, name, shape, table)
    if a is None:
        if optional:
            return None
        raise KVSimdTypeError("%s must be a float32 array of shape %s, got None" % (name, shape))
    _kvsimd._need_array(a, name, (np.dtype(F32),), len(shape), str(shape))
    if any(want is not None and got != want for got, want in zip(a.shape, shape)) or 0 in a.shape:
        raise KVSimdValueError("%s must have shape %s, got %s"
                               % (name, str(shape).replace("None", "n >= 1"), a.shape))
    return a


def need_norm(nw, name, d, optional=False):
    if nw is None and optional:
        return
    if not isinstance(nw, NormWeights):
        raise KVSimdTypeError("%s must be a NormWeights, got %r" % (name, type(nw).__name__))
    need_weight(nw.w, name + ".w", (d,))
    need_weight(nw.b, name + ".b", (d,), optional=True)


def _need_attention(a, name, d, d_kv_in, H, Hkv, Dh, fused):
    if not isinstance(a, AttentionWeights):
        raise KVSimdTypeError("%s must be an AttentionWeights, got %r" % (name, type(a).__name__))
    for part, shape in (("wq", (d, H * Dh)), ("wk", (d_kv_in, Hkv * Dh)), ("wv", (d_kv_in, Hkv * Dh)),
                        ("wo", (H * Dh, d))):
        need_weight(getattr(a, part), "%s.%s" % (name, part), shape)
    for part, n in (("bq", H * Dh), ("bk", Hkv * Dh), ("bv", Hkv * Dh), ("bo", d)):
        need_weight(getattr(a, part), "%s.%s" % (name, part), (n,), optional=True)
    if fused:
        n = (H + 2 * Hkv) * Dh
        need_weight(a.wqkv, name + ".wqkv", (d, n))
        need_weight(a.bqkv, name + ".bqkv", (n,), optional=True)


def check_layer(cfg, lw, name, d_source=None):
    """Every array of one layer against the ModelConfig: shapes, float32, C-contiguity.
    ``d_source``: width of the encoder output when the layer has cross-attention."""
    if not isinstance(lw, LayerWeights):
        raise KVSimdTypeError("%s must be a LayerWeights, got %r" % (name, type(lw).__name__))
    d, H, Hkv, Dh, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    need_norm(lw.norm1, name + ".norm1", d)
    need_norm(lw.norm2, name + ".norm2", d)
    for flag, parts, width in (("qk_norm", ("q_norm", "k_norm"), Dh), ("post_norms", ("post_norm1", "post_norm2"), d)):
        for part in parts:
            nw = getattr(lw, part)
            if getattr(cfg, flag):
                need_norm(nw, "%s.%s" % (name, part), width)
            elif nw is not None:
                raise KVSimdValueError("%s.%s is set but the config has %s=False" % (name, part, flag))
    _need_attention(lw.attn, name + ".attn", d, d, H, Hkv, Dh, True)
    if d_source is not None:
        need_norm(lw.norm_cross, name + ".norm_cross", d)
        _need_attention(lw.cross, name + ".cross", d, d_source, H, Hkv, Dh, False)
    f = lw.ffn
    if not isinstance(f, FFNWeights):
        raise KVSimdTypeError("%s.ffn must be an FFNWeights, got %r" % (name, type(f).__name__))
    need_weight(f.w1, name + ".ffn.w1", (d, F))
    need_weight(f.w2, name + ".ffn.w2", (F, d))
    need_weight(f.b2, name + ".ffn.b2", (d,), optional=True)
    if cfg.ffn_gated:
        need_weight(f.w3, name + ".ffn.w3", (d, F))
        need_weight(f.w13, name + ".ffn.w13", (d, 2 * F))
        if f.b1 is not None:
            raise KVSimdValueError("%s.ffn.b1: a gated FFN (ffn_gated=True) takes no b1" % name)
    else:
        if f.w3 is not None or f.w13 is not None:
            raise KVSimdValueError("%s.ffn.w3 is set but the config has ffn_gated=False" % name)
        need_weight(f.b1, name + ".ffn.b1", (F,), optional=True)


# ------------------------------------------------------------------------------ packing
def _norm(cfg, nw, name, width=None):
    return None if nw is None else _kvsimd.Norm(nw.w, nw.b, cfg.norm == "rmsnorm", cfg.norm_eps,
                                                cfg.d_model if width is None else width, name=name)


def pack_layers(cfg, layers, name="layers", d_source=None):
    """The compiled layer stack of ``layers`` (LayerWeights already checked against ``cfg``):
    one typed Block per layer, holding the same arrays (nothing is copied)."""
    blocks = []
    for i, lw in enumerate(layers):
        p = "%s[%d]" % (name, i)
        a, f, c = lw.attn, lw.ffn, lw.cross
        gated = f.w13 is not None
        blocks.append(_kvsimd.Block(
            _norm(cfg, lw.norm1, p + ".norm1"),
            _kvsimd.Linear(a.wqkv, a.bqkv, name=p + ".attn.wqkv"),
            _kvsimd.Linear(a.wo, a.bo, name=p + ".attn.wo"),
            _norm(cfg, lw.norm2, p + ".norm2"),
            _kvsimd.Linear(f.w13 if gated else f.w1, None if gated else f.b1,
                           name=p + (".ffn.w13" if gated else ".ffn.w1")),
            _kvsimd.Linear(f.w2, f.b2, name=p + ".ffn.w2"),
            None if c is None or d_source is None else _norm(cfg, lw.norm_cross, p + ".norm_cross"),
            None if c is None or d_source is None else _kvsimd.Linear(c.wq, c.bq, name=p + ".cross.wq"),
            None if c is None or d_source is None else _kvsimd.Linear(c.wo, c.bo, name=p + ".cross.wo"),
            None if c is None or d_source is None else _kvsimd.Linear(c.wkv, c.bkv, name=p + ".cross.wkv"),
            q_norm=_norm(cfg, lw.q_norm, p + ".q_norm", cfg.head_dim),
            k_norm=_norm(cfg, lw.k_norm, p + ".k_norm", cfg.head_dim),
            post_attn=_norm(cfg, lw.post_norm1, p + ".post_norm1"), post_ffn=_norm(cfg, lw.post_norm2, p + ".post_norm2")))
    return _kvsimd.Layers(blocks, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                          head_dim=cfg.head_dim, activation=cfg.activation, gated=cfg.ffn_gated,
                          pre_norm=cfg.pre_norm, parallel_residual=cfg.parallel_residual,
                          windows=layer_windows(cfg))


# ------------------------------------------------------------------------------ storing float weights
# weights= of from_transformers: the stored type of every matrix (None: float32 arrays, BLAS)
WEIGHT_FORMATS = {"float32": None, "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}


def need_format(weights):
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise KVSimdValueError("weights must be one of %s, got %r" % (", ".join(map(repr, WEIGHT_FORMATS)), weights))
    return weights


def stored_matrix(rows, wtype, name):
    """float32 ``rows`` ``[r, c]`` (a torch-order ``[out, in]`` matrix, or an embedding table)
    stored as a QMatrix of ``wtype``, quantized by the ``gguf`` package (the encoder llama.cpp's
    files are written with)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    rows = np.ascontiguousarray(rows, dtype=F32)
    raw = np.ascontiguousarray(quantize(rows, GGMLQuantizationType[wtype.upper()])).view(np.uint8)
    return QMatrix(raw.reshape(rows.shape[0], -1), wtype, rows.shape, name=name)


def _rows(w, table):
    """A matrix as float32 rows ``[out, in]`` (or an embedding table as it is)."""
    if isinstance(w, QMatrix):
        return w.dequantize()
    return w if table else w.T


def store_weights(model, weights):
    """Convert every matrix of ``model`` (a Decoder or EncoderDecoder) to the type ``weights``
    names (:data:`WEIGHT_FORMATS`), in place: "float32" gives float32 arrays ``[in, out]``
    (stored matrices dequantized), the others QMatrix weights quantized from the float values.  A
    matrix whose inputs are not whole blocks of the type (Q8_0: 32) is stored as float16 instead;
    a warning names them.  A tied output projection shares the embedding's storage."""
    need_format(weights)
    wtype = WEIGHT_FORMATS[weights]
    block = 1 if wtype is None else _kvsimd.weight_types()[wtype]["block"]
    fallback = []

    def conv(w, name, table=False):
        if wtype is None and not isinstance(w, QMatrix):
            return w
        rows = _rows(w, table)
        if wtype is None:
            return np.ascontiguousarray(rows if table else rows.T)
        t = wtype
        if rows.shape[1] % block:
            t = "f16"
            fallback.append("%s (%d inputs)" % (name, rows.shape[1]))
        return stored_matrix(rows, t, name)

    def parts(obj, names, prefix):   # a copy of a weights dataclass with its matrices converted
        return dataclasses.replace(obj, **{n: conv(getattr(obj, n), prefix + n)
                                           for n in names if getattr(obj, n) is not None})

    def layers(ls, prefix):
        for i, lw in enumerate(ls):
            p = "%s[%d]." % (prefix, i)
            lw.attn = parts(lw.attn, ("wq", "wk", "wv", "wo"), p + "attn.")
            if lw.cross is not None:
                lw.cross = parts(lw.cross, ("wq", "wk", "wv", "wo"), p + "cross.")
            lw.ffn = parts(lw.ffn, ("w1", "w2", "w3"), p + "ffn.")

    def same(a, b):   # b (a projection [in, out]) is a's table transposed, or the same storage
        if isinstance(a, QMatrix) or isinstance(b, QMatrix):
            return a is b
        return a.shape == b.T.shape and np.array_equal(a, b.T)

    layers(model.layers, "layers")
    if getattr(model, "enc_layers", None) is not None:
        layers(model.enc_layers, "enc_layers")
    embed, head = model.embed, model.lm_head
    model.embed = conv(embed, "embed", table=True)
    if same(embed, head):
        model.lm_head = model.embed if isinstance(model.embed, QMatrix) else np.ascontiguousarray(model.embed.T)
    else:
        model.lm_head = conv(head, "lm_head")
    enc = model.__dict__.get("enc_embed")
    if enc is not None:
        model.enc_embed = model.embed if (enc is embed or (not isinstance(enc, QMatrix) and not isinstance(embed, QMatrix)
                                                            and np.array_equal(enc, embed))) \
            else conv(enc, "enc_embed", table=True)
    if fallback:
        import warnings
        warnings.warn("weights=%r: %s not whole blocks of %d values: stored as float16"
                      % (weights, ", ".join(fallback), block), stacklevel=3)
    return model
