"""The GGUF files the decode bench runs, built with the ``gguf`` package and kept in the model
cache (:func:`kvsimd.loaders.registry.cache_dir`, ``$KVSIMD_CACHE``), never in the repository.

* :func:`smollm2_variant` -- the real SmolLM2-135M-Instruct GGUF (Q4_1 projections, a Q8_0
  embedding) requantized to Q8_0 or F16: every 2-D tensor dequantized by ``gguf`` and quantized
  again with ``gguf.quants.quantize`` (F16: a float16 cast), 1-D tensors (the norms) copied as
  they are, every metadata key (tokenizer included) copied with its type; ``general.file_type``
  names the new type.
* :func:`llama3_8b_shaped` -- a GGUF of Llama-3-8B's shapes (32 layers, d_model 4096, 32/8 heads
  of 128, FFN 14336, vocabulary 128256, RoPE theta 500000, untied output) with random Q4_0
  weights: random nibbles and small random fp16 scales written as blocks directly (no 8e9
  floats are quantized), F32 norms, and a minimal byte-level BPE tokenizer (the 256 byte tokens,
  a few merges, Llama 3's special tokens) that kvsimd's loader and llama.cpp accept.  About 4.5 GB,
  written tensor by tensor (the largest, the embedding, is ~300 MB in memory at once).

Each file is written as ``<name>.part.<pid>`` and renamed when complete, so a file that exists
is whole; it is built only when missing.  ``python -m kvsimd.bench.models smollm2|llama3-8b``
builds (or finds) the files and prints their paths."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from kvsimd.errors import KVSimdValueError
from kvsimd.loaders import registry

SMOLLM2_WEIGHTS = ("Q4_1", "Q8_0", "F16")     # Q4_1: the file as published
LLAMA3_8B = dict(vocab=128256, d=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                 rope_theta=500000.0, context=8192, tied=False)


def _log(log, msg):
    if log:
        print("kvsimd.bench.models: %s" % msg, file=log, flush=True)


def _qtype(name):
    import gguf
    try:
        return gguf.GGMLQuantizationType[name]
    except KeyError:
        raise KVSimdValueError("weights must be one of %s, got %r" % (", ".join(SMOLLM2_WEIGHTS), name)) from None


def _tensor_bytes(shape, qtype):
    """Bytes of a tensor of NumPy-order ``shape`` stored as ``qtype``."""
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise KVSimdValueError("rows of %d values do not fit %s blocks of %d" % (shape[-1], qtype.name, block))
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def _write_gguf(dest, arch, kv, tensors, log=None):
    """Write a GGUF file tensor by tensor: ``kv`` is a list of (key, value, GGUFValueType,
    sub_type); ``tensors`` a list of (name, NumPy-order shape, qtype, make) where ``make()``
    returns the tensor's data (float32/float16 of the shape, or uint8 rows of blocks), called
    once each, in order, after the header is on disk.  Written to a ``.part`` file, renamed when
    whole."""
    import gguf
    part = "%s.part.%d" % (dest, os.getpid())
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    w = gguf.GGUFWriter(part, arch)
    try:
        for key, value, vtype, sub in kv:
            w.add_key_value(key, value, vtype, sub)
        for name, shape, qt, _ in tensors:
            nbytes = _tensor_bytes(shape, qt)
            if qt == gguf.GGMLQuantizationType.F32:
                w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
            elif qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
            else:       # byte rows: the writer turns the byte shape into the element shape
                w.add_tensor_info(name, tuple(shape[:-1]) + (nbytes // int(np.prod(shape[:-1], dtype=np.int64)),),
                                  np.dtype(np.uint8), nbytes, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        t0, done, total = time.perf_counter(), 0, len(tensors)
        for i, (name, shape, qt, make) in enumerate(tensors):
            data = make()
            if data.nbytes != _tensor_bytes(shape, qt):
                raise AssertionError("%s: %d bytes made, %d expected" % (name, data.nbytes, _tensor_bytes(shape, qt)))
            w.write_tensor_data(data)
            done += data.nbytes
            del data
            if log and (i + 1) % 32 == 0:
                _log(log, "%d/%d tensors, %.2f GB in %.0f s" % (i + 1, total, done / 1e9, time.perf_counter() - t0))
        w.close()
        os.replace(part, dest)
    except BaseException:
        w.close()
        if os.path.exists(part):
            os.remove(part)
        raise
    return dest


# ------------------------------------------------------------------------------ SmolLM2 requantized
def smollm2_variant(weights="Q4_1", log=sys.stderr):
    """Path of SmolLM2-135M-Instruct with its projections and embedding stored as ``weights``
    ("Q4_1": the published file; "Q8_0" or "F16": requantized from it, built once into the cache)."""
    if weights not in SMOLLM2_WEIGHTS:
        raise KVSimdValueError("weights must be one of %s, got %r" % (", ".join(SMOLLM2_WEIGHTS), weights))
    src = registry.smollm2_path(log=log)
    if weights == "Q4_1":
        return src
    dest = os.path.join(registry.cache_dir(), registry.SMOLLM2_FILE.replace(".Q4_1.", ".%s." % weights))
    if os.path.isfile(dest):
        return dest
    _log(log, "building %s (requantized from %s) ..." % (dest, os.path.basename(src)))
    requantize(src, dest, weights)
    _log(log, "saved %s" % dest)
    return dest


def requantize(src, dest, weights):
    """Copy GGUF ``src`` to ``dest`` with every 2-D tensor stored as ``weights`` (F16, Q8_0, or any
    type ``gguf.quants.quantize`` writes); 1-D tensors and all metadata copied as they are."""
    import gguf
    from gguf.quants import dequantize, quantize
    qt = _qtype(weights)
    r = gguf.GGUFReader(src)
    kv = []
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":   # the writer's own
            continue
        main = f.types[0]
        value = f.contents()
        if f.name == "general.file_type":
            value = int(getattr(gguf.LlamaFileType, "MOSTLY_" + weights))
        sub = f.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if main == gguf.GGUFValueType.ARRAY and len(f.types) != 2:
            raise KVSimdValueError("%s: metadata %s is an array of arrays (not copied by this tool)" % (src, f.name))
        kv.append((f.name, value, main, sub))
    arch = r.fields["general.architecture"].contents()
    tensors = []
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))        # NumPy order
        if len(shape) < 2:
            tensors.append((t.name, shape, t.tensor_type, lambda t=t: np.asarray(t.data).reshape(-1)))
            continue

        def make(t=t, shape=shape):
            x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if qt == gguf.GGMLQuantizationType.F32:
                return x
            if qt == gguf.GGMLQuantizationType.F16:
                return x.astype(np.float16)
            return quantize(x, qt)
        tensors.append((t.name, shape, qt, make))
    return _write_gguf(dest, arch, kv, tensors)


# ------------------------------------------------------------------------------ random Llama files
def _bytes_to_unicode():
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


# a few merges of common English pairs, so that the merge list is not empty (llama.cpp needs one)
_MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "o u", "n d", "Ġ o"]


def tokenizer_metadata(vocab):
    """A minimal byte-level BPE vocabulary of ``vocab`` tokens (GGUF ``gpt2`` tokenizer): the
    256 byte tokens, the merges' tokens, filler tokens, and, as the last 256 ids when the
    vocabulary is large enough (Llama 3: 128000 and 128001 are begin/end of text), control
    tokens.  Returns (tokens, token_types, merges, bos_id, eos_id)."""
    base = [_bytes_to_unicode()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in _MERGES]
    n_special = 256 if vocab >= 1024 else 2
    n_fill = vocab - n_special - len(base) - len(merged)
    if n_fill < 0:
        raise KVSimdValueError("vocab must be at least %d, got %d" % (len(base) + len(merged) + n_special, vocab))
    special = ["<|begin_of_text|>", "<|end_of_text|>"] + ["<|reserved_special_token_%d|>" % i
                                                         for i in range(n_special - 2)]
    tokens = base + merged + ["<|filler_%d|>" % i for i in range(n_fill)] + special
    types = [1] * (vocab - n_special) + [3] * n_special
    bos = vocab - n_special
    return tokens, types, list(_MERGES), bos, bos + 1


def llama_tensors(spec):
    """(name, NumPy-order shape) of a Llama model's tensors in the order llama.cpp's converter
    writes them."""
    d, F, V, Dh = spec["d"], spec["ffn"], spec["vocab"], spec["head_dim"]
    q, kv = spec["heads"] * Dh, spec["kv_heads"] * Dh
    out = [("token_embd.weight", (V, d))]
    for i in range(spec["layers"]):
        p = "blk.%d." % i
        out += [(p + "attn_norm.weight", (d,)), (p + "attn_q.weight", (q, d)), (p + "attn_k.weight", (kv, d)),
                (p + "attn_v.weight", (kv, d)), (p + "attn_output.weight", (d, q)), (p + "ffn_norm.weight", (d,)),
                (p + "ffn_gate.weight", (F, d)), (p + "ffn_up.weight", (F, d)), (p + "ffn_down.weight", (d, F))]
    out.append(("output_norm.weight", (d,)))
    if not spec.get("tied"):
        out.append(("output.weight", (V, d)))
    return out


def random_blocks(rows, cols, qtype, rng):
    """Random weights of a [rows, cols] matrix as ``qtype`` blocks, made directly: Q4_0 random
    nibbles (values -8..7 times the scale), Q8_0 random int8 in [-127, 127]; fp16 scales drawn in
    [0.5, 1.5] x the scale that gives the weights a standard deviation of about 1/sqrt(cols)
    (a matrix-vector product keeps the magnitude of its input).  F32/F16: normal values."""
    import gguf
    std = 1.0 / np.sqrt(cols)
    Q = gguf.GGMLQuantizationType
    if qtype in (Q.F32, Q.F16):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(
            np.float32 if qtype == Q.F32 else np.float16)
    nb = rows * (cols // 32)
    if qtype == Q.Q4_0:
        unit, size = 4.61, 18         # std of (nibble - 8) for uniform nibbles
    elif qtype == Q.Q8_0:
        unit, size = 73.6, 34         # std of uniform int8 in [-127, 127]
    else:
        raise KVSimdValueError("random weights are made as F32, F16, Q4_0 or Q8_0, not %s" % qtype.name)
    blocks = np.frombuffer(bytearray(rng.bytes(nb * size)), dtype=np.uint8).reshape(nb, size)
    if qtype == Q.Q8_0:              # -128 is not a value the quantizer writes
        q = blocks[:, 2:].view(np.int8)
        q[q == -128] = -127
    scales = (rng.uniform(0.5, 1.5, nb) * (std / unit)).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, (cols // 32) * size)


def write_random_llama(path, spec, weights="Q4_0", seed=0, name=None, log=None):
    """Write a Llama-architecture GGUF of shapes ``spec`` (vocab, d, layers, heads, kv_heads,
    head_dim, ffn, rope_theta, context, tied) with random ``weights`` (Q4_0, Q8_0, F16, F32) in
    every 2-D tensor, F32 norms near 1 and the minimal tokenizer of :func:`tokenizer_metadata`."""
    import gguf
    T = gguf.GGUFValueType
    qt = _qtype(weights)
    tokens, types, merges, bos, eos = tokenizer_metadata(spec["vocab"])
    ftype = getattr(gguf.LlamaFileType, "ALL_F32" if weights == "F32" else "MOSTLY_" + weights)
    kv = [("general.type", "model", T.STRING, None),
          ("general.name", name or "random llama %d layers d=%d" % (spec["layers"], spec["d"]), T.STRING, None),
          ("general.file_type", int(ftype), T.UINT32, None),
          ("general.quantization_version", 2, T.UINT32, None),
          ("llama.block_count", spec["layers"], T.UINT32, None),
          ("llama.context_length", spec["context"], T.UINT32, None),
          ("llama.embedding_length", spec["d"], T.UINT32, None),
          ("llama.feed_forward_length", spec["ffn"], T.UINT32, None),
          ("llama.attention.head_count", spec["heads"], T.UINT32, None),
          ("llama.attention.head_count_kv", spec["kv_heads"], T.UINT32, None),
          ("llama.attention.key_length", spec["head_dim"], T.UINT32, None),
          ("llama.attention.value_length", spec["head_dim"], T.UINT32, None),
          ("llama.rope.freq_base", float(spec["rope_theta"]), T.FLOAT32, None),
          ("llama.rope.dimension_count", spec["head_dim"], T.UINT32, None),
          ("llama.attention.layer_norm_rms_epsilon", 1e-5, T.FLOAT32, None),
          ("llama.vocab_size", spec["vocab"], T.UINT32, None),
          ("tokenizer.ggml.model", "gpt2", T.STRING, None),
          ("tokenizer.ggml.pre", "llama-bpe", T.STRING, None),
          ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
          ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
          ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING),
          ("tokenizer.ggml.bos_token_id", bos, T.UINT32, None),
          ("tokenizer.ggml.eos_token_id", eos, T.UINT32, None),
          ("tokenizer.ggml.add_bos_token", False, T.BOOL, None)]
    rng = np.random.default_rng(seed)
    tensors = []
    for tname, shape in llama_tensors(spec):
        if len(shape) == 1:
            tensors.append((tname, shape, gguf.GGMLQuantizationType.F32,
                            lambda shape=shape: (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)))
        else:
            tensors.append((tname, shape, qt, lambda shape=shape: random_blocks(shape[0], shape[1], qt, rng)))
    return _write_gguf(os.fspath(path), "llama", kv, tensors, log=log)


def llama3_8b_shaped(weights="Q4_0", log=sys.stderr):
    """Path of the Llama-3-8B-shaped GGUF with random ``weights`` (Q4_0: ~4.5 GB), built once
    into the cache (a few minutes: random bytes and the disk)."""
    dest = os.path.join(registry.cache_dir(), "llama3-8b-shaped-random.%s.gguf" % weights)
    if os.path.isfile(dest):
        return dest
    n = sum(_tensor_bytes(s, _qtype("F32" if len(s) == 1 else weights)) for _, s in llama_tensors(LLAMA3_8B))
    _log(log, "building %s (%.2f GB of random %s weights) ..." % (dest, n / 1e9, weights))
    t0 = time.perf_counter()
    write_random_llama(dest, LLAMA3_8B, weights, name="Llama-3-8B-shaped (random weights)", log=log)
    _log(log, "saved %s in %.0f s" % (dest, time.perf_counter() - t0))
    return dest


NAMES = {"smollm2": lambda log: [smollm2_variant(w, log) for w in SMOLLM2_WEIGHTS],
         "llama3-8b": lambda log: [llama3_8b_shaped("Q4_0", log)]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=sorted(NAMES), help="smollm2: the Q4_1 file and its Q8_0/F16 variants; "
                    "llama3-8b: the random Llama-3-8B-shaped Q4_0 file")
    args = ap.parse_args(argv)
    for p in NAMES[args.which](sys.stderr):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
