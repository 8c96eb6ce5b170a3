"""Load GGUF files (llama.cpp's format) of the architectures in :data:`ARCHITECTURES`.

The header, metadata and tensor directory are parsed here, every count, length and offset
checked against the file's size before it is used (a damaged file is a :class:`GGUFError`, never
a huge allocation or a read past the end).  Then, in one place (:func:`check_gguf`) and before any
tensor is dequantized, the metadata is checked (types, ranges) and turned into a
:class:`ModelConfig`, the tokenizer metadata is checked, and every tensor's type and shape is
compared with a table of expected shapes computed from the config.

Weights stay as the file stores them: the file is memory-mapped and every matrix of a type kvsimd
multiplies in place (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: ``WEIGHT_TYPES``) becomes
a :class:`kvsimd.QMatrix` over its bytes in the map -- nothing is copied or dequantized, so a load
costs the directory parse and one scan of the scales (a tensor whose values or block scales hold
NaN or inf is an error).  A matrix of another type ``gguf`` can dequantize (Q5_0, Q2_K, ...) is
dequantized to float32 once, with a warning naming it.  Vectors (norms, biases) are small: copied
as float32.  ``mmap=False`` copies the stored bytes into the process instead (same types, same
memory; the file may then change or vanish under a running model, which a memory map does not
allow: truncating a mapped file makes the process fault when it next reads the lost pages).

llama.cpp's converter permutes the Q/K projection rows so that RoPE rotates adjacent pairs (GPT-J
style), so a GGUF model is run with ``rope_style="gptj"`` on its weights as stored -- equivalent to
transformers' NeoX ``rotate_half`` on the unpermuted weights, because q.k is unchanged when q and k
are permuted alike.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from typing import NamedTuple

import numpy as np

from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError
from kvsimd.nn.config import F32, ModelConfig
from kvsimd.nn.weights import AttentionWeights, FFNWeights, LayerWeights, NormWeights

# the types kvsimd multiplies as stored (src_c/wtypes.def); SUPPORTED_TYPES adds those dequantized at load
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = WEIGHT_TYPES + ("Q5_0", "Q5_1", "Q2_K", "Q3_K")
# byte offsets of the half-precision scale fields in each block of a quantized type (GGUF's block
# layouts): the load checks them finite without dequantizing the tensor
_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                      # ggml's GGML_MAX_DIMS
MAX_COUNT = (1 << 31) - 1         # model sizes (layers, heads, widths, vocabulary) must fit in int32

# GGUF metadata value types: id -> (name, struct format or None)
_VALUE_TYPES = {0: ("UINT8", "B"), 1: ("INT8", "b"), 2: ("UINT16", "H"), 3: ("INT16", "h"), 4: ("UINT32", "I"),
                5: ("INT32", "i"), 6: ("FLOAT32", "f"), 7: ("BOOL", "?"), 8: ("STRING", None), 9: ("ARRAY", None),
                10: ("UINT64", "Q"), 11: ("INT64", "q"), 12: ("FLOAT64", "d")}
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_FLOAT_TYPES = {"FLOAT32", "FLOAT64"}


class GGUFError(KVSimdError, ValueError):
    """A GGUF file that is missing, damaged, or of an architecture/tensor type not supported."""


class TensorInfo(NamedTuple):
    name: str
    shape: tuple          # NumPy order (ggml lists the fastest axis first: this is reversed)
    qtype: object         # gguf.GGMLQuantizationType
    offset: int           # absolute byte offset in the file
    nbytes: int


class MetaValue(NamedTuple):
    type: str             # "UINT32", "STRING", "ARRAY[STRING]", ...
    value: object         # int/float/bool/str, a list of str, or a 1-D NumPy array


class _Cursor:
    """Reads little-endian values from a buffer; every read is checked against its end."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def take(self, n, what):
        if n < 0 or n > self.size - self.pos:
            raise GGUFError("%s: truncated or damaged: %s needs %d bytes at offset %d, the file has %d"
                            % (self.path, what, n, self.pos, self.size))
        p = self.pos
        self.pos += n
        return p

    def unpack(self, fmt, what):
        p = self.take(struct.calcsize("<" + fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, p)[0]

    def string(self, what):
        n = self.unpack("Q", what + " length")
        p = self.take(n, what)
        try:
            return bytes(self.buf[p:p + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError("%s: %s at offset %d is not UTF-8 (%s)" % (self.path, what, p, e)) from None

    def value(self, tid, what, in_array=False):
        if tid not in _VALUE_TYPES:
            raise GGUFError("%s: %s has unknown value type %d" % (self.path, what, tid))
        name, fmt = _VALUE_TYPES[tid]
        if fmt is not None:
            return MetaValue(name, self.unpack(fmt, what))
        if name == "STRING":
            return MetaValue(name, self.string(what))
        if in_array:
            raise GGUFError("%s: %s is an array of arrays (not supported)" % (self.path, what))
        itid = self.unpack("I", what + " element type")
        n = self.unpack("Q", what + " element count")
        if itid not in _VALUE_TYPES:
            raise GGUFError("%s: %s has unknown element type %d" % (self.path, what, itid))
        iname, ifmt = _VALUE_TYPES[itid]
        if ifmt is not None:      # one vectorized read, bounded by the file
            size = struct.calcsize(ifmt)
            p = self.take(n * size, "%s (%d %s)" % (what, n, iname))
            arr = np.frombuffer(self.buf, dtype=np.dtype("<" + ifmt), count=n, offset=p).copy()
            return MetaValue("ARRAY[%s]" % iname, arr)
        if n > (self.size - self.pos) // 8:    # every element needs at least its 8-byte length
            raise GGUFError("%s: truncated or damaged: %s claims %d elements, more than the file can hold"
                            % (self.path, what, n))
        if iname == "STRING":
            return MetaValue("ARRAY[STRING]", self.strings(n, what))
        return MetaValue("ARRAY[%s]" % iname, [self.value(itid, what, True).value for _ in range(n)])

    def strings(self, n, what):
        """``n`` strings in a row (a vocabulary: ~10^5 of them), in one tight loop; every length is
        checked against the end of the file as in :meth:`string`."""
        buf, pos, end, out = self.buf, self.pos, self.size, []
        length = struct.Struct("<Q").unpack_from
        append = out.append
        try:
            for _ in range(n):
                if end - pos < 8:
                    break
                m = length(buf, pos)[0]
                pos += 8
                if m > end - pos:
                    pos -= 8
                    break
                append(str(buf[pos:pos + m], "utf-8"))
                pos += m
        except UnicodeDecodeError:
            pass
        if len(out) < n:          # stopped early: report the bad element as string() does
            self.pos = pos
            self.string("%s[%d]" % (what, len(out)))
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF file's header, metadata (``meta``: key -> :class:`MetaValue`) and tensor directory
    (``tensors``: name -> :class:`TensorInfo`), all checked against the file's size.  Tensor data
    stays on disk (memory-mapped) until :meth:`read`."""

    def __init__(self, path):
        try:
            path = os.fspath(path)
        except TypeError:
            raise KVSimdTypeError("path must be a str or os.PathLike, got %r" % (path,)) from None
        self.path = path
        if os.path.isdir(path):
            raise GGUFError("%s is a directory, not a GGUF file" % path)
        if not os.path.isfile(path):
            raise GGUFError("GGUF file not found: %s" % path)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 24:
                    raise GGUFError("%s is not a readable GGUF file (truncated or damaged?): %d bytes" % (path, size))
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError("cannot read %s: %s" % (path, e.strerror or e)) from None
        self.size = size
        self.dequantized = []     # (tensor, type) of the matrices stored() dequantized
        self._parse(memoryview(self._map))

    def _parse(self, buf):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        path = self.path
        if bytes(buf[:4]) != MAGIC:
            raise GGUFError("%s is not a readable GGUF file (truncated or damaged?): magic %r, expected %r"
                            % (path, bytes(buf[:4]), MAGIC))
        c = _Cursor(buf, path)
        c.take(4, "magic")
        self.version = c.unpack("I", "version")
        if self.version not in VERSIONS:
            what = "big-endian or " if self.version & 0xFFFF == 0 else ""
            raise GGUFError("%s: GGUF version %d is not supported (%sunknown; supported: %s)"
                            % (path, self.version, what, ", ".join(map(str, VERSIONS))))
        n_tensors = c.unpack("Q", "tensor count")
        n_kv = c.unpack("Q", "metadata count")
        # each metadata pair needs >= 13 bytes (key length, type, a 1-byte value), each tensor >= 32
        if n_kv * 13 + n_tensors * 32 > self.size - c.pos:
            raise GGUFError("%s: truncated or damaged: header claims %d metadata keys and %d tensors, more than "
                            "the file's %d bytes can hold" % (path, n_kv, n_tensors, self.size))
        self.meta = {}
        for i in range(n_kv):
            key = c.string("metadata key #%d" % i)
            if key in self.meta:
                raise GGUFError("%s: metadata key %s appears twice" % (path, key))
            self.meta[key] = c.value(c.unpack("I", "type of " + key), "metadata " + key)
        align = self.meta.get("general.alignment", MetaValue("UINT32", 32))
        if align.type != "UINT32" or align.value < 1 or align.value & (align.value - 1):
            raise GGUFError("%s: metadata general.alignment=%r (%s): must be a UINT32 power of two"
                            % (path, align.value, align.type))
        infos = []
        for i in range(n_tensors):
            name = c.string("tensor name #%d" % i)
            n_dims = c.unpack("I", "dimension count of tensor " + name)
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError("%s: tensor %s has %d dimensions (1..%d allowed)" % (path, name, n_dims, MAX_DIMS))
            dims = [c.unpack("Q", "dimensions of tensor " + name) for _ in range(n_dims)]
            tid = c.unpack("I", "type of tensor " + name)
            offset = c.unpack("Q", "data offset of tensor " + name)
            try:
                qtype = GGMLQuantizationType(tid)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError("%s: tensor %s has unknown type id %d" % (path, name, tid)) from None
            if min(dims) < 1 or max(dims) > MAX_COUNT:
                raise GGUFError("%s: tensor %s has dimensions %s (each must be 1..%d)" % (path, name, dims, MAX_COUNT))
            if dims[0] % block:
                raise GGUFError("%s: tensor %s of type %s has rows of %d values, not a multiple of its block of %d"
                                % (path, name, qtype.name, dims[0], block))
            infos.append((name, tuple(reversed(dims)), qtype, offset, math.prod(dims) // block * type_size))
        data_start = -(-c.pos // align.value) * align.value
        self.tensors = {}
        for name, shape, qtype, offset, nbytes in infos:
            if name in self.tensors:
                raise GGUFError("%s: tensor %s appears twice" % (path, name))
            if offset % align.value or data_start + offset + nbytes > self.size:
                raise GGUFError("%s: truncated or damaged: tensor %s (%s, %d bytes) at data offset %d does not fit "
                                "in the file (%d bytes, data from %d, alignment %d)"
                                % (path, name, qtype.name, nbytes, offset, self.size, data_start, align.value))
            self.tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, nbytes)

    def close(self):
        """Unmap the file (metadata and the tensors already read stay valid)."""
        try:
            self._map.close()
        except BufferError:   # a view of a tensor is still alive somewhere: the map goes with it
            pass

    def get(self, key, default=None):
        v = self.meta.get(key)
        return default if v is None else v.value

    def _raw(self, t, copy):
        raw = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.copy() if copy else raw

    def _non_finite(self, t, raw):
        """(count, first flat index) of NaN/inf among a tensor's values (float types) or block
        scales (quantized types), without dequantizing it."""
        name = t.qtype.name
        if name == "F32":
            bad = ~np.isfinite(raw.view(np.float32))
        elif name in ("F16", "BF16"):
            mask = 0x7C00 if name == "F16" else 0x7F80   # exponent all ones: inf or NaN
            bad = (raw.view(np.uint16) & mask) == mask
        else:
            from gguf.constants import GGML_QUANT_SIZES
            block, size = GGML_QUANT_SIZES[t.qtype]
            blocks = raw.reshape(-1, size)
            bad = np.zeros(blocks.shape[0], bool)
            for off in _SCALE_FIELDS.get(name, ()):
                h = blocks[:, off].astype(np.uint16) | (blocks[:, off + 1].astype(np.uint16) << 8)
                bad |= (h & 0x7C00) == 0x7C00
            n = int(np.count_nonzero(bad))
            return n * block, (int(np.argmax(bad)) * block if n else 0)
        n = int(np.count_nonzero(bad))
        return n, (int(np.argmax(bad)) if n else 0)

    def _need_finite(self, t, raw):
        bad, first = self._non_finite(t, raw)
        if bad:
            index = tuple(int(i) for i in np.unravel_index(first, t.shape))
            raise GGUFError("%s: tensor %s holds %d NaN/inf values (first at index %s)"
                            % (self.path, t.name, bad, index))

    def stored(self, name, copy=False, activations="int8", rows=None):
        """Matrix ``name`` as stored: a :class:`kvsimd.QMatrix` over its bytes in the map (or over
        a private copy of them with ``copy``), or, for a type kvsimd has no kernel for, over its
        float32 dequantization (``self.dequantized`` lists those).  NaN/inf is an error.
        ``activations``: "int8" where the type and shape allow it (QMatrix's default), or "float32".
        ``rows``: (r0, r1), rows r0..r1-1 only (a part of a fused projection: a view, no copy)."""
        from kvsimd._kvsimd import QMatrix
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise GGUFError("%s: tensor %s has shape %s, expected a matrix" % (self.path, name, list(t.shape)))
        r0, r1 = (0, t.shape[0]) if rows is None else rows
        label = name if rows is None else "%s[%d:%d]" % (name, r0, r1)
        if t.qtype.name not in WEIGHT_TYPES:
            w = np.ascontiguousarray(self.read(name)[r0:r1])
            self.dequantized.append((label, t.qtype.name))
            return QMatrix(w.view(np.uint8).reshape(r1 - r0, -1), "f32", w.shape, name=label)
        row_bytes = t.nbytes // t.shape[0]
        t = t._replace(name=label, shape=(r1 - r0, t.shape[1]), offset=t.offset + r0 * row_bytes,
                       nbytes=(r1 - r0) * row_bytes)
        raw = self._raw(t, copy)
        self._need_finite(t, raw)
        q = QMatrix(raw, t.qtype.name.lower(), t.shape, name=label,
                    activations="float32" if activations == "float32" else None)
        if not copy and q.activations == "int8":
            self._release(t)
        return q

    def _release(self, t):
        """Drop the map's pages of tensor (part) t from the process (its products read the
        QMatrix's repacked copy): they stay in the page cache, and a later read of the stored
        bytes (``take``, ``raw``) maps them again.  Whole pages inside the tensor only."""
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page
        end = (t.offset + t.nbytes) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):   # an advice only: memory use, not correctness
                pass

    def read(self, name):
        """Tensor ``name`` dequantized to a C-contiguous float32 array of its shape; NaN/inf is an error."""
        from gguf.quants import dequantize
        t = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        try:
            w = dequantize(raw.reshape(-1, t.nbytes // max(1, math.prod(t.shape[:-1]))), t.qtype)
        except Exception as e:
            raise GGUFError("%s: cannot read tensor %s (%s): %s" % (self.path, name, t.qtype.name, e)) from None
        # a copy, never a view of the mapped file (a file truncated under a view would SIGBUS)
        w = np.array(w, dtype=F32, order="C", copy=True if t.qtype.name == "F32" else None).reshape(t.shape)
        bad = np.size(w) - np.count_nonzero(np.isfinite(w))
        if bad:
            first = np.unravel_index(int(np.argmin(np.isfinite(w))), w.shape)
            raise GGUFError("%s: tensor %s holds %d NaN/inf values (first at index %s: %r)"
                            % (self.path, name, bad, tuple(int(i) for i in first), float(w[first])))
        return w


def open_gguf(path):
    """Parse a GGUF file's header, metadata and tensor directory (no tensor data is read)."""
    return GGUFFile(path)


# ------------------------------------------------------------------------------ typed, checked metadata
_REQUIRED = object()


def _meta(gf, key, default, kinds, expected):
    v = gf.meta.get(key)
    if v is None:
        if default is _REQUIRED:
            raise GGUFError("%s: metadata key %s is missing" % (gf.path, key))
        return None
    if v.type not in kinds:
        raise GGUFError("%s: metadata %s has type %s, expected %s" % (gf.path, key, v.type, expected))
    return v


def meta_int(gf, key, default=_REQUIRED, lo=1, hi=MAX_COUNT):
    """An integer metadata value in [lo, hi] (any GGUF integer type; not a bool, float or string)."""
    v = _meta(gf, key, default, _INT_TYPES, "an integer")
    if v is None:
        return default
    if not lo <= v.value <= hi:
        raise GGUFError("%s: metadata %s=%d: must be in [%d, %d]" % (gf.path, key, v.value, lo, hi))
    return int(v.value)


def meta_float(gf, key, default=_REQUIRED):
    """A finite, positive number."""
    v = _meta(gf, key, default, _FLOAT_TYPES | _INT_TYPES, "a number")
    if v is None:
        return default
    if not (math.isfinite(v.value) and v.value > 0):
        raise GGUFError("%s: metadata %s=%r: must be a finite number > 0" % (gf.path, key, v.value))
    return float(v.value)


def meta_str(gf, key, default=_REQUIRED):
    v = _meta(gf, key, default, {"STRING"}, "a string")
    return default if v is None else v.value


def meta_bool(gf, key, default=_REQUIRED):
    v = _meta(gf, key, default, {"BOOL"}, "a bool")
    return default if v is None else bool(v.value)


def meta_list(gf, key, element, default=_REQUIRED):
    """An array of strings (``element="STRING"``) or of integers (``element="INT"``)."""
    kinds = {"ARRAY[STRING]"} if element == "STRING" else {"ARRAY[%s]" % t for t in _INT_TYPES}
    v = _meta(gf, key, default, kinds, "an array of " + ("strings" if element == "STRING" else "integers"))
    return default if v is None else v.value


# ------------------------------------------------------------------------------ architectures
class Arch(NamedTuple):
    """What one GGUF architecture needs beyond the Llama layout (llama.cpp's tensor names and
    metadata keys, ``{arch}.`` prefixed).  Every field maps to a general option of ModelConfig or
    of the tensor table; no family is special-cased anywhere else."""
    rope_style: str = "neox"          # llama.cpp's converter permutes q/k rows only for llama ("gptj" pairs)
    fused_qkv: bool = False           # blk.N.attn_qkv.weight: rows q | k | v
    fused_gate_up: bool = False       # blk.N.ffn_up.weight: rows gate | up (no ffn_gate)
    qk_norm: bool = False             # blk.N.attn_q_norm / attn_k_norm [head_dim]
    post_norms: bool = False          # blk.N.post_attention_norm / post_ffw_norm
    activation: str = "silu"
    embed_scale_sqrt_d: bool = False  # embeddings times sqrt(d_model)
    softcaps: bool = False            # {arch}.attn_logit_softcapping / final_logit_softcapping
    window_every: int = 0             # {arch}.attention.sliding_window on layers i % n == 0 (1: all layers)


ARCHITECTURES = {
    "llama": Arch(rope_style="gptj"),        # Llama 1-3, SmolLM, Mistral (general.name says which)
    "qwen2": Arch(),                         # q/k/v biases (optional tensors of every family)
    "qwen3": Arch(qk_norm=True),
    "phi3": Arch(fused_qkv=True, fused_gate_up=True, window_every=1),
    "gemma2": Arch(post_norms=True, activation="gelu_tanh", embed_scale_sqrt_d=True, softcaps=True,
                   window_every=2),
}


def _arch(gf):
    arch = meta_str(gf, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError("%s: architecture %r is not supported (supported: %s)"
                        % (gf.path, arch, ", ".join(ARCHITECTURES)))
    return arch, ARCHITECTURES[arch]


def _attention_scale(gf, a, arch, d, H, head_dim, n_layers):
    """``{arch}.attention.scale`` when the file has it; else what llama.cpp uses for the family:
    Gemma 2's 27B model (46 layers of 4608) scales by 1/sqrt(d_model / heads), every other model
    by 1/sqrt(head_dim) (None)."""
    scale = meta_float(gf, arch + ".attention.scale", None)
    if scale is None and arch == "gemma2" and (n_layers, d) == (46, 4608):
        scale = 1.0 / math.sqrt(d // H)
    return scale


ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def _rope_scaling(gf, k, rot):
    """``ModelConfig.rope_scaling`` from a file's RoPE metadata: ``{arch}.rope.scaling.type`` none,
    linear (``.factor``) or yarn (``.factor``, ``.original_context_length``, optional
    ``.yarn_beta_fast`` / ``.yarn_beta_slow``), and the ``rope_freqs`` tensor (per-pair divisors of
    the frequencies: how llama.cpp's converter stores Llama 3.1's adjustment).  What these
    families' files carry; anything else (Phi-3's long/short factors, yarn's attention-factor and
    log-multiplier variants) is refused naming it."""
    p = gf.path
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in gf.tensors:
            raise GGUFError("%s: tensor %s (Phi-3 \"longrope\" scaling) is not supported (supported RoPE scaling: "
                            "%s, and the rope_freqs tensor)" % (p, name, ", ".join(ROPE_SCALING_TYPES)))
    kind = meta_str(gf, k + "rope.scaling.type", "none")
    if kind not in ROPE_SCALING_TYPES:
        raise GGUFError("%s: metadata %srope.scaling.type=%r is not supported (supported: %s, and the rope_freqs "
                        "tensor)" % (p, k, kind, ", ".join(ROPE_SCALING_TYPES)))
    for key, neutral in (("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.0)):
        v = _meta(gf, k + key, None, _FLOAT_TYPES | _INT_TYPES, "a number")
        if v is not None and v.value != neutral:     # llama.cpp's variants beyond what these families' files use
            raise GGUFError("%s: metadata %s%s=%r is not supported (only %r)" % (p, k, key, v.value, neutral))
    sc = {"type": "default" if kind == "none" else kind}
    if kind in ("linear", "yarn"):
        sc["factor"] = meta_float(gf, k + "rope.scaling.factor")
    if kind == "yarn":
        sc["original_max_position_embeddings"] = meta_int(gf, k + "rope.scaling.original_context_length")
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = meta_float(gf, k + "rope.scaling." + key, None)
            if v is not None:
                sc[name] = v
    t = gf.tensors.get("rope_freqs.weight")
    if t is not None:
        if t.shape != (rot // 2,):
            raise GGUFError("%s: tensor rope_freqs.weight has shape %s, expected [%d] (rope.dimension_count / 2)"
                            % (p, list(t.shape), rot // 2))
        sc["freq_factors"] = tuple(float(x) for x in gf.read("rope_freqs.weight"))
    return None if sc == {"type": "default"} else sc


def config_from_gguf(gf):
    """The checked :class:`ModelConfig` of a GGUF file of a supported architecture (its tokenizer
    metadata checked too: token ids index the embedding)."""
    p = gf.path
    arch, a = _arch(gf)
    k = arch + "."
    d = meta_int(gf, k + "embedding_length")
    H = meta_int(gf, k + "attention.head_count")
    Hkv = meta_int(gf, k + "attention.head_count_kv", H)
    if H % Hkv:
        raise GGUFError("%s: metadata %sattention.head_count=%d is not a multiple of %sattention.head_count_kv=%d"
                        % (p, k, H, k, Hkv))
    if k + "attention.key_length" not in gf.meta and d % H:
        raise GGUFError("%s: metadata %sembedding_length=%d is not a multiple of %sattention.head_count=%d "
                        "(and %sattention.key_length is absent)" % (p, k, d, k, H, k))
    head_dim = meta_int(gf, k + "attention.key_length", d // H)
    v_dim = meta_int(gf, k + "attention.value_length", head_dim)
    if v_dim != head_dim:
        raise GGUFError("%s: metadata %sattention.value_length=%d differs from key_length=%d (not supported)"
                        % (p, k, v_dim, head_dim))
    rot = meta_int(gf, k + "rope.dimension_count", head_dim)
    if rot % 2 or rot > head_dim:
        raise GGUFError("%s: metadata %srope.dimension_count=%d: must be even and at most the head dimension %d"
                        % (p, k, rot, head_dim))
    n_layers = meta_int(gf, k + "block_count")
    if n_layers > len(gf.tensors):   # each layer has tensors: this bounds the table of expected shapes
        raise GGUFError("%s: metadata %sblock_count=%d but the file holds only %d tensors"
                        % (p, k, n_layers, len(gf.tensors)))
    tok = tokenizer_spec(gf)
    vocab = meta_int(gf, k + "vocab_size", len(tok["tokens"]))
    if vocab != len(tok["tokens"]):   # token ids index the embedding rows: both must agree
        raise GGUFError("%s: metadata %svocab_size=%d but tokenizer.ggml.tokens has %d tokens"
                        % (p, k, vocab, len(tok["tokens"])))
    scaling = _rope_scaling(gf, k, rot)
    windows = None
    window = meta_int(gf, k + "attention.sliding_window", 0, 0) if a.window_every else 0
    if window:
        windows = tuple(window if i % a.window_every == 0 else 0 for i in range(n_layers))
    fields = dict(
        vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=H, n_kv_heads=Hkv,
        head_dim=head_dim, ffn_dim=meta_int(gf, k + "feed_forward_length"), activation=a.activation, ffn_gated=True,
        norm="rmsnorm", norm_eps=meta_float(gf, k + "attention.layer_norm_rms_epsilon", 1e-5),
        position="rope", rope_theta=meta_float(gf, k + "rope.freq_base", 10000.0), rope_style=a.rope_style,
        rotary_dim=rot, rope_scaling=scaling, max_positions=meta_int(gf, k + "context_length", 4096),
        embed_scale=math.sqrt(d) if a.embed_scale_sqrt_d else 1.0, qk_norm=a.qk_norm, post_norms=a.post_norms,
        attn_scale=_attention_scale(gf, a, arch, d, H, head_dim, n_layers),
        attn_softcap=meta_float(gf, k + "attn_logit_softcapping", 0.0) if a.softcaps else 0.0,
        final_softcap=meta_float(gf, k + "final_logit_softcapping", 0.0) if a.softcaps else 0.0,
        attn_windows=windows, bos_token_id=tok["bos_id"], eos_token_id=tok["eos_id"], family=arch + "-gguf")
    try:    # the config's own rules (e.g. RoPE theta as the kernels accept it), named as the file's
        return ModelConfig(**fields)
    except KVSimdError as e:
        raise GGUFError("%s: the metadata gives an unusable config: %s" % (p, e)) from None


# tokenizer.ggml.model -> what it is; llama.cpp's defaults for a "llama" file that leaves an id out
TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece-style BPE"}
_LLAMA_DEFAULT_IDS = {"unknown": 0, "bos": 1, "eos": 2}


def tokenizer_spec(gf):
    """The checked tokenizer metadata: a dict of kind, tokens, merges (gpt2), scores (llama), types,
    the pre-tokenizer name (gpt2), bos/eos/unk/pad ids, add_bos/add_eos/add_space_prefix, template.

    A "llama" file that leaves out an id or flag gets llama.cpp's defaults: unknown 0, bos 1, eos 2,
    add_bos and add_space_prefix true.  A gpt2 file's ``tokenizer.ggml.pre`` must be one of
    :data:`kvsimd.loaders.tokenizer.PRE_TOKENIZERS` (absent: GPT-2's split): an unknown one is an
    error, not a silent fall back to another split that would give the model ids it was not trained on."""
    from kvsimd.loaders.tokenizer import PRE_TOKENIZERS
    if getattr(gf, "_tokenizer_spec", None) is not None:
        return gf._tokenizer_spec
    p = gf.path
    kind = meta_str(gf, "tokenizer.ggml.model")
    if kind not in TOKENIZER_KINDS:
        raise GGUFError("%s: metadata tokenizer.ggml.model=%r is not supported (supported: %s)"
                        % (p, kind, ", ".join("%r (%s)" % kv for kv in TOKENIZER_KINDS.items())))
    llama = kind == "llama"
    tokens = meta_list(gf, "tokenizer.ggml.tokens", "STRING")
    if not tokens:
        raise GGUFError("%s: metadata tokenizer.ggml.tokens is empty" % p)
    n = len(tokens)
    if len(set(tokens)) != n:   # a repeated token would leave one of its ids undecodable
        first = {}
        for i, t in enumerate(tokens):
            if t in first:
                raise GGUFError("%s: metadata tokenizer.ggml.tokens[%d]=%r repeats tokens[%d]" % (p, i, t, first[t]))
            first[t] = i
    merges = meta_list(gf, "tokenizer.ggml.merges", "STRING", [])
    for i, m in enumerate(merges):
        if " " not in m:
            raise GGUFError("%s: metadata tokenizer.ggml.merges[%d]=%r is not two tokens separated by a space"
                            % (p, i, m))
    types = meta_list(gf, "tokenizer.ggml.token_type", "INT", None)
    if types is None:
        types = [1] * n
    elif len(types) != n:
        raise GGUFError("%s: metadata tokenizer.ggml.token_type has %d entries for %d tokens" % (p, len(types), n))
    scores = _meta(gf, "tokenizer.ggml.scores", _REQUIRED if llama else None, {"ARRAY[FLOAT32]", "ARRAY[FLOAT64]"},
                   "an array of floats")
    if scores is not None:
        scores = scores.value
        if len(scores) != n:
            raise GGUFError("%s: metadata tokenizer.ggml.scores has %d entries for %d tokens" % (p, len(scores), n))
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            raise GGUFError("%s: metadata tokenizer.ggml.scores[%d]=%r: must be finite"
                            % (p, bad[0], float(scores[bad[0]])))
        scores = scores.tolist()
    pre = meta_str(gf, "tokenizer.ggml.pre", None)
    if not llama and pre is not None and pre not in PRE_TOKENIZERS:   # llama.cpp ignores it for "llama"
        raise GGUFError("%s: metadata tokenizer.ggml.pre=%r is not supported for tokenizer.ggml.model='gpt2' "
                        "(supported: %s)" % (p, pre, ", ".join(map(repr, PRE_TOKENIZERS))))
    ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        default = _LLAMA_DEFAULT_IDS.get(name) if llama else None
        ids[name] = meta_int(gf, "tokenizer.ggml.%s_token_id" % name,
                             default if default is not None and default < n else None, 0, n - 1)
    gf._tokenizer_spec = dict(kind=kind, tokens=tokens, merges=merges, types=[int(t) for t in types],
                              scores=scores, pre=pre, bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"],
                              pad_id=ids["padding"], chat_template=meta_str(gf, "tokenizer.chat_template", None),
                              add_bos=meta_bool(gf, "tokenizer.ggml.add_bos_token", llama),
                              add_eos=meta_bool(gf, "tokenizer.ggml.add_eos_token", False),
                              add_space_prefix=meta_bool(gf, "tokenizer.ggml.add_space_prefix", llama))
    return gf._tokenizer_spec


def _arch_of(cfg):
    return ARCHITECTURES[cfg.family[:-len("-gguf")]]


def expected_tensors(cfg):
    """name -> (NumPy-order shape, required) of every tensor a GGUF file of ``cfg``'s architecture
    may hold (llama.cpp's names)."""
    a = _arch_of(cfg)
    d, V, F, Dh = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.head_dim
    q, kv = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    table = {"token_embd.weight": ((V, d), True), "output_norm.weight": ((d,), True), "output.weight": ((V, d), False),
             "rope_freqs.weight": ((cfg.rotary_dim // 2,), False)}
    for i in range(cfg.n_layers):
        p = "blk.%d." % i
        table.update({
            p + "attn_norm.weight": ((d,), True), p + "ffn_norm.weight": ((d,), True),
            p + "attn_output.weight": ((d, q), True), p + "ffn_down.weight": ((d, F), True)})
        if a.fused_qkv:
            table[p + "attn_qkv.weight"] = ((q + 2 * kv, d), True)
        else:
            table.update({p + "attn_q.weight": ((q, d), True), p + "attn_k.weight": ((kv, d), True),
                          p + "attn_v.weight": ((kv, d), True), p + "attn_q.bias": ((q,), False),
                          p + "attn_k.bias": ((kv,), False), p + "attn_v.bias": ((kv,), False)})
        if a.fused_gate_up:
            table[p + "ffn_up.weight"] = ((2 * F, d), True)
        else:
            table.update({p + "ffn_gate.weight": ((F, d), True), p + "ffn_up.weight": ((F, d), True)})
        if a.qk_norm:
            table.update({p + "attn_q_norm.weight": ((Dh,), True), p + "attn_k_norm.weight": ((Dh,), True)})
        if a.post_norms:
            table.update({p + "post_attention_norm.weight": ((d,), True), p + "post_ffw_norm.weight": ((d,), True)})
    return table


def check_gguf(gf):
    """Everything about a GGUF file that can be checked without reading tensor data, in one place:
    metadata -> config, tokenizer metadata, then every tensor's name, type and shape against the
    table from the config.  Returns ``(cfg, tokenizer_spec)``."""
    p = gf.path
    cfg = config_from_gguf(gf)
    spec = tokenizer_spec(gf)         # checked (and kept) by config_from_gguf
    table = expected_tensors(cfg)
    arch = cfg.family[:-len("-gguf")]
    for name, t in gf.tensors.items():
        if name not in table:
            raise GGUFError("%s: tensor %s is not part of a %d-layer %s model (not supported)"
                            % (p, name, cfg.n_layers, arch))
        if t.qtype.name not in SUPPORTED_TYPES:
            raise GGUFError("%s: tensor %s has type %s, not supported (supported: %s)"
                            % (p, name, t.qtype.name, ", ".join(SUPPORTED_TYPES)))
        if t.shape != table[name][0]:
            raise GGUFError("%s: tensor %s has shape %s, expected %s from the metadata"
                            % (p, name, list(t.shape), list(table[name][0])))
    for name, (shape, required) in table.items():
        if required and name not in gf.tensors:
            raise GGUFError("%s: tensor %s is missing" % (p, name))
    return cfg, spec


def _splits(cfg):
    """Fused matrices of the architecture -> their parts' (suffix, first row, end row)."""
    a = _arch_of(cfg)
    q, kv, F = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    out = {}
    for i in range(cfg.n_layers):
        p = "blk.%d." % i
        if a.fused_qkv:
            out[p + "attn_qkv.weight"] = (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))
        if a.fused_gate_up:
            out[p + "ffn_up.weight"] = (("gate", 0, F), ("up", F, 2 * F))
    return out


def load_tensors(gf, copy=False, activations="int8", splits=None):
    """name -> tensor: matrices as stored (:meth:`GGUFFile.stored`, ggml order ``[out, in]``),
    vectors (norms, biases) as float32 arrays.  ``splits``: fused matrix -> its parts (suffix,
    r0, r1), loaded as ``name#suffix`` (views of the rows, no copy)."""
    splits = splits or {}
    out = {}
    for name, t in gf.tensors.items():
        if name == "rope_freqs.weight":     # read into the config (rope_scaling)
            continue
        if name in splits:
            for suffix, r0, r1 in splits[name]:
                out[name + "#" + suffix] = gf.stored(name, copy, activations, rows=(r0, r1))
        else:
            out[name] = gf.stored(name, copy, activations) if len(t.shape) == 2 else gf.read(name)
    return out


def decoder_kwargs_from_gguf(path, mmap=True, activations="int8"):
    """Decoder constructor arguments and the parsed file (which :meth:`Tokenizer.from_gguf` reads).
    Nothing is read before the whole file checked out, tokenizer included.  Matrices stay as the
    file stores them (views of the memory map; private copies with ``mmap=False``)."""
    from kvsimd.loaders.tokenizer import Tokenizer
    gf = open_gguf(path)
    cfg, _ = check_gguf(gf)
    Tokenizer.from_gguf(gf)          # built (and kept on gf) before any tensor is read
    a = _arch_of(cfg)
    try:
        w = load_tensors(gf, copy=not mmap, activations=activations, splits=_splits(cfg))
    finally:
        gf.close()    # unmaps only when nothing views the map any more (mmap=False, or no matrix)
    if gf.dequantized:
        import warnings
        warnings.warn("%s: no kvsimd kernel for %s: dequantized to float32 at load (more memory, slower)"
                      % (path, ", ".join("%s (%s)" % nt for nt in gf.dequantized)), stacklevel=3)

    def norm(name):
        return NormWeights(w[name]) if name in w else None

    layers = []
    for i in range(cfg.n_layers):
        p = "blk.%d." % i
        qkv = [w[p + "attn_qkv.weight#" + x] for x in "qkv"] if a.fused_qkv else \
            [w[p + "attn_%s.weight" % x] for x in "qkv"]
        gate, up = (w[p + "ffn_up.weight#gate"], w[p + "ffn_up.weight#up"]) if a.fused_gate_up else \
            (w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"])
        at = AttentionWeights(*qkv, w[p + "attn_output.weight"], w.get(p + "attn_q.bias"), w.get(p + "attn_k.bias"),
                              w.get(p + "attn_v.bias"))
        f = FFNWeights(gate, w[p + "ffn_down.weight"], up)
        layers.append(LayerWeights(at, f, NormWeights(w[p + "attn_norm.weight"]), NormWeights(w[p + "ffn_norm.weight"]),
                                   q_norm=norm(p + "attn_q_norm.weight"), k_norm=norm(p + "attn_k_norm.weight"),
                                   post_norm1=norm(p + "post_attention_norm.weight"),
                                   post_norm2=norm(p + "post_ffw_norm.weight")))
    embed = w["token_embd.weight"]
    head = w.get("output.weight", embed)    # tied embeddings: the same stored rows
    return dict(cfg=cfg, embed=embed, layers=layers, final_norm=NormWeights(w["output_norm.weight"]),
                lm_head=head), gf


__all__ = ["GGUFError", "GGUFFile", "open_gguf", "check_gguf", "config_from_gguf", "tokenizer_spec",
           "expected_tensors", "load_tensors", "decoder_kwargs_from_gguf", "KVSimdValueError", "WEIGHT_TYPES",
           "ARCHITECTURES"]
