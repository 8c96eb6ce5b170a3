"""GGUF files of every supported architecture (tests/gguf_families.py: tiny random transformers
models written as llama.cpp lays them out), loaded by kvsimd and by transformers (``gguf_file=``)
from the same bytes: prompt logits within the model bounds of tests/test_models.py and greedy
tokens identical, with float32 and float16 caches and F32, Q8_0 and Q4_K matrices."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the model tests need the test extra: torch==2.13.0")
transformers = pytest.importorskip("transformers", reason="the model tests need the test extra: transformers")

import gguf_families as gf  # noqa: E402
from kvsimd import Decoder  # noqa: E402
from kvsimd.loaders.gguf import ARCHITECTURES, GGUFError  # noqa: E402
from kvsimd.testing import INT8_ACTIVATION_BOUND, assert_matches_reference  # noqa: E402

transformers.logging.set_verbosity_error()
FAMILIES = list(gf.hf_configs())
QTYPES = ["F32", "Q8_0", "Q4_K"]
TOL = {"float32": 1e-4, "float16": 2e-2}      # as tests/test_models.py (same model sizes, same reasoning)
_FILES = {}


def family_file(tmp_dir, family, qtype):
    """(path, transformers model loaded from it, kvsimd Decoder with float32 activations), made once."""
    key = (family, qtype)
    if key not in _FILES:
        arch, name, cfg = gf.hf_configs()[family]
        torch.manual_seed(sum(map(ord, family)))
        src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        path = os.path.join(tmp_dir, "%s-%s.gguf" % (family, qtype))
        gf.write(path, family, src, qtype)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_dir, gguf_file=os.path.basename(path),
                                                                   dtype=torch.float32).eval()
        _FILES[key] = (path, theirs, Decoder.from_gguf(path, activations="float32"))
    return _FILES[key]


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


def hf_logits(m, toks):
    with torch.no_grad():
        return m(torch.tensor(np.asarray(toks)[None])).logits[0].double().numpy()


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


def hf_greedy(m, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        past, inp = None, torch.tensor([seq])
        for _ in range(n):
            out = m(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            seq.append(int(out.logits[0, -1].argmax()))
            inp = torch.tensor([[seq[-1]]])
    return seq[len(prompt):]


def test_every_architecture_is_tested():
    assert {gf.hf_configs()[f][0] for f in FAMILIES} == set(ARCHITECTURES)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gguf_logits_and_greedy_tokens_match_transformers(tmp_dir, family, qtype, dtype, rng):
    path, theirs, ours = family_file(tmp_dir, family, qtype)
    assert ours.cfg.family == gf.hf_configs()[family][0] + "-gguf"
    toks = rng.integers(3, gf.vocab(family), 24)
    ref = hf_logits(theirs, toks)
    cache = ours.new_cache(capacity=64, dtype=dtype)
    errs = [rel(ours.prefill(toks[:14], cache=cache, all_logits=True), ref[:14])]
    errs += [rel(ours.step([t], cache=cache)[0], ref[i]) for i, t in enumerate(toks[14:], 14)]
    assert max(errs) <= TOL[dtype], (family, qtype, dtype, max(errs))
    prompt = list(rng.integers(3, gf.vocab(family), 9))
    got = list(ours.generate(prompt, max_new_tokens=32, cache_dtype=dtype, stop_tokens=()))
    want = hf_greedy(theirs, prompt, 32)
    if dtype == "float32":
        assert got == want
    elif got != want:       # fp16 K/V: the first difference must be a near tie of transformers' own logits
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        last = hf_logits(theirs, prompt + want[:i])[-1]
        gap = (last[want[i]] - last[got[i]]) / np.abs(last).max()
        assert 0 <= gap <= TOL[dtype], (family, qtype, i, gap)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_int8_activations_within_their_bound(tmp_dir, family, rng):
    """The default load (int8 activations for Q8_0/Q4_K matrices) against the float64 reference
    of the same stored weights rounded as the kernel rounds x."""
    path, _, _ = family_file(tmp_dir, family, "Q8_0")
    d = Decoder.from_gguf(path)
    toks = rng.integers(3, gf.vocab(family), 20)
    assert_matches_reference(d, toks, d.forward(toks), bound=INT8_ACTIVATION_BOUND)


def test_unsupported_architecture_is_one_line_listing_the_supported(tmp_dir):
    path, _, _ = family_file(tmp_dir, "qwen2", "F32")
    data = bytearray(open(path, "rb").read())
    i = data.index(b"qwen2")          # general.architecture's value, the first "qwen2" in the file
    data[i:i + 5] = b"mamba"
    bad = os.path.join(tmp_dir, "mamba.gguf")
    open(bad, "wb").write(bytes(data))
    with pytest.raises(GGUFError) as e:
        Decoder.from_gguf(bad)
    msg = str(e.value)
    assert "\n" not in msg and "architecture 'mamba' is not supported" in msg
    assert "supported: " + ", ".join(ARCHITECTURES) in msg


# ------------------------------------------------------------------------------ infinite generation
NEW = ["mistral-window", "qwen2-window", "qwen3", "phi3", "phi3-window", "gemma2"]


@pytest.mark.parametrize("policy", ["shift", "sink_query", "reevaluate"])
@pytest.mark.parametrize("family", NEW)
def test_streaming_past_the_cache_window_matches_transformers_on_the_kept_tokens(family, policy, rng):
    """Every policy of a RoPE model, past the cache's window (capacity 12, 2 sinks) with layer
    windows of 6 keys: each step's logits are transformers' logits of the kept tokens (at positions
    0..L-1).  "shift" and "sink_query" keep K/V computed beside the dropped tokens, which only the
    first layer's do not depend on: their models have one layer."""
    import copy
    import test_models as tm
    cfg = copy.deepcopy(tm.causal_models()[family])
    cfg.num_hidden_layers = 2 if policy == "reevaluate" else 1
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = 6
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
        if family == "qwen2-window":      # its one windowed layer is layer 1: make the first one windowed
            cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    torch.manual_seed(3)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    d = Decoder.from_transformers(m)
    cap, nk, nd = 12, 2, 3
    cache = d.new_cache(capacity=cap, n_keep=nk, policy=policy, n_discard=nd, dtype="float32")
    toks = rng.integers(0, tm.V, 34)
    kept = list(toks[:5])
    d.prefill(kept, cache=cache)
    for t in toks[5:]:
        if len(kept) == cap:
            kept = kept[:nk] + kept[nk + (1 if policy == "sink_query" else nd):]
        kept.append(t)
        got = d.step([t], cache=cache)[0]
        assert rel(got, tm.hf_logits(m, kept)[-1]) <= TOL["float32"], (family, policy, len(kept))


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cli_generates_with_every_architecture(tmp_dir, family, chat):
    """`python -m kvsimd generate --model FILE.gguf [--chat]` prints the text the API generates
    from the prompt (wrapped in the file's chat template)."""
    import subprocess
    import sys
    path, _, _ = family_file(tmp_dir, family, "Q8_0")
    m = Decoder.from_gguf(path)
    tok = m.tokenizer
    prompt = "The king is dead."
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    assert (text != prompt) == chat
    gen = m.generate(tok.encode(text), max_new_tokens=8, stop_tokens=[] if tok.eos_id is None else [tok.eos_id])
    want = tok.decode(list(gen))
    r = subprocess.run([sys.executable, "-m", "kvsimd", "generate", "--model", path, "--max-new-tokens", "8"]
                       + ["--chat"] * chat + [prompt], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout in (want, want + "\n"), (r.stdout, want)   # (a newline ends the output)


# ------------------------------------------------------------------------------ what transformers' GGUF loader ignores
SOURCE_CASES = {   # name -> (family, config overrides), each past the original context / the window
    "llama-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0))),
    "llama-llama3": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=64))),
    "llama-yarn": ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                      original_max_position_embeddings=64))),
    "phi3-partial-window": ("phi3", dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5),
                                         sliding_window=24)),
}


@pytest.mark.parametrize("name", list(SOURCE_CASES))
def test_gguf_metadata_against_the_source_model(tmp_dir, name, rng):
    """Metadata transformers' GGUF loader does not read, so the reference is the transformers model
    the file was written from: RoPE scaling as llama.cpp's files carry it (rope.scaling.type linear
    / yarn with factor and original context; Llama 3.1's adjustment as the rope_freqs tensor), and
    Phi-3's partial rotary dimension and sliding window; 100 tokens (past the original context of 64
    and the window of 24)."""
    fam, over = SOURCE_CASES[name]
    arch, gname, base = gf.hf_configs()[fam]
    cfg = type(base)(**dict(base.to_dict(), **over))
    torch.manual_seed(5)
    src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = os.path.join(tmp_dir, name + ".gguf")
    gf.write(path, fam, src)
    ours = Decoder.from_gguf(path, activations="float32")
    sc = ours.cfg.rope_scaling
    if fam == "llama":
        assert sc["type"] == {"llama-llama3": "default"}.get(name, name.split("-")[1])
        assert ("freq_factors" in sc) == (name == "llama-llama3")
    else:
        assert sc is None and ours.cfg.rotary_dim == ours.cfg.head_dim // 2 and ours.cfg.attn_windows == (24, 24)
    toks = rng.integers(3, gf.vocab(fam), 100)
    cache = ours.new_cache(capacity=128, dtype="float32")
    got = np.concatenate([ours.prefill(toks[:70], cache=cache, all_logits=True)]
                         + [ours.step([t], cache=cache) for t in toks[70:]])
    assert rel(got, hf_logits(src, toks)) <= TOL["float32"]


def test_gguf_rope_scaling_outside_these_families_is_refused(tmp_dir):
    import gguf
    src = transformers.AutoModelForCausalLM.from_config(gf.hf_configs()["llama"][2]).eval()
    for key, value, vtype, msg in [
            ("llama.rope.scaling.type", "longrope", gguf.GGUFValueType.STRING,
             r"rope\.scaling\.type='longrope' is not supported \(supported: none, linear, yarn"),
            ("llama.rope.scaling.attn_factor", 0.5, gguf.GGUFValueType.FLOAT32,
             r"rope\.scaling\.attn_factor=0\.5 is not supported")]:
        path = os.path.join(tmp_dir, "bad-scaling.gguf")
        real = gf.metadata

        def meta(*a, **kw):
            m = real(*a, **kw)
            m[key] = (value, vtype)
            if key.endswith("attn_factor"):
                m["llama.rope.scaling.type"] = ("yarn", gguf.GGUFValueType.STRING)
                m["llama.rope.scaling.factor"] = (2.0, gguf.GGUFValueType.FLOAT32)
                m["llama.rope.scaling.original_context_length"] = (64, gguf.GGUFValueType.UINT32)
            return m
        gf.metadata = meta
        try:
            gf.write(path, "llama", src)
        finally:
            gf.metadata = real
        with pytest.raises(GGUFError, match=msg):
            Decoder.from_gguf(path)


def test_transformers_from_gguf_keeps_what_transformers_loaded(tmp_dir, tmp_path, monkeypatch):
    """kvsimd.bench.hf.transformers_from_gguf, the SmolLM2 reference of the model tests and the hf
    bench, kept converted in $KVSIMD_CACHE: what it returns, converting and then read back from its
    copy, is transformers' own GGUF load (the same tensors, logits and tokens); a changed file is
    converted again."""
    from kvsimd.bench.hf import transformers_from_gguf
    monkeypatch.setenv("KVSIMD_CACHE", str(tmp_path))
    path, theirs, _ = family_file(tmp_dir, "llama", "Q8_0")
    # half-written copies: one of a process that is gone (removed), one of a live one (this process: kept)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "hf" / ("x.gguf-1-2-tf0.tmp" + gone)).mkdir(parents=True)
    (tmp_path / "hf" / ("x.gguf-1-2-tf0.tmp%d" % os.getpid())).mkdir()
    first = transformers_from_gguf(path)
    live = "x.gguf-1-2-tf0.tmp%d" % os.getpid()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if ".tmp" in p.name) == [live]
    (tmp_path / "hf" / live).rmdir()
    again, tok = transformers_from_gguf(path, tokenizer=True)
    assert len(os.listdir(tmp_path / "hf")) == 1
    want = theirs.state_dict()
    toks = [1, 5, 9, 2, 7]
    for m in (first, again):
        got = m.state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert np.array_equal(hf_logits(m, toks), hf_logits(theirs, toks))
    direct = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = "the old king said to his daughters"
    assert tok(text).input_ids == direct(text).input_ids
    from kvsimd import KVSimdError, KVSimdTypeError
    with pytest.raises(KVSimdError, match="not found"):
        transformers_from_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(KVSimdTypeError, match="path must be a str or os.PathLike, got 5"):
        transformers_from_gguf(5)
    (tmp_path / "junk.gguf").write_bytes(b"junk" * 10)
    with pytest.raises(KVSimdError, match="not a readable GGUF file"):
        transformers_from_gguf(str(tmp_path / "junk.gguf"))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    transformers_from_gguf(path)
    assert len(os.listdir(tmp_path / "hf")) == 2
    # a bytes path is the same file (transformers takes str paths: it is decoded)
    assert torch.equal(transformers_from_gguf(os.fsencode(path)).model.norm.weight, want["model.norm.weight"])
    assert len(os.listdir(tmp_path / "hf")) == 2
    # another file of the same name, size and mtime, elsewhere (cp -p), with another final norm
    other = tmp_path / "elsewhere" / os.path.basename(path)
    other.parent.mkdir()
    shutil.copyfile(path, other)
    from kvsimd.loaders.gguf import open_gguf
    g = open_gguf(str(other))
    t = g.tensors["output_norm.weight"]
    off, n = t.offset, t.nbytes
    g.close()
    with open(other, "r+b") as fh:
        fh.seek(off)
        fh.write(np.full(n // 4, 2.0, np.float32).tobytes())
    st = os.stat(path)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(other).st_size == st.st_size and os.stat(other).st_mtime_ns == st.st_mtime_ns
    assert (transformers_from_gguf(str(other)).model.norm.weight == 2.0).all()
    assert len(os.listdir(tmp_path / "hf")) == 3
