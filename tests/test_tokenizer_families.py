"""GGUF tokenizers of the Qwen2/Qwen3 ("gpt2" kind), Mistral, Llama-2, Phi-3 and Gemma-2 ("llama"
kind) families, on tiny files written by tests/ggufmodels.py, against two independent references:

- transformers' own GGUF tokenizer conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``),
  which reads only the file's metadata.  It picks a tokenizer builder by ``general.architecture``;
  for the "llama" kind two of them implement llama.cpp's tokenizer: the "phi3" builder (a space put
  before every stretch of text, as llama.cpp does with ``add_space_prefix``) and the "gemma2" one
  (no space).  So the files written for comparison name the architecture of the builder that matches
  their ``add_space_prefix``; the tokenizer kvsimd builds reads only ``tokenizer.*`` keys.
- :func:`llama_cpp_spm`, llama.cpp's SentencePiece algorithm as llama-vocab.cpp describes it, written
  here from that description, for what transformers does differently (see each test).
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import gguf
import ggufmodels
from kvsimd.loaders.gguf import GGUFError, tokenizer_spec, open_gguf
from kvsimd.loaders.tokenizer import Tokenizer

V = gguf.GGUFValueType

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space", "  two leading spaces",
    "trailing space ", "trailing two  ", "a  b   c    d", "line one\nline two\n\n", "\n", " ", "", "\ttab\tand  spaces",
    "numbers 12345, 3.14 and 2024!", "x1 y22 z333 w4444 55555", "café naïve Zürich crème brûlée",
    "emoji 🙂 👍🏽 and 中文 字", "don't we'll THEY'RE it's", "def add(a, b):\n    return a + b\n",
    "ÀÉÎÕÜ ß ŒŁ", "mixed\r\nline endings\r", "\u2581 a literal space marker",
]

# case -> add_tokenizer arguments
CASES = {
    "qwen2": dict(kind="gpt2", family="qwen2"),
    "qwen3": dict(kind="gpt2", family="qwen3"),                       # user-defined <think> </think>
    "qwen2-add-bos-eos": dict(kind="gpt2", family="qwen2", add_bos=True, add_eos=True),
    "gpt2-pre-llama-bpe": dict(kind="gpt2", family="qwen2", pre="llama-bpe"),
    "gpt2-pre-gpt2": dict(kind="gpt2", family="qwen2", pre="gpt2"),
    "gpt2-no-pre": dict(kind="gpt2", family="qwen2", meta={"tokenizer.ggml.pre": None}),
    "mistral": dict(kind="llama", family="mistral"),                   # control [INST] [/INST] inside the text
    "llama2": dict(kind="llama", family="llama2"),
    "phi3": dict(kind="llama", family="phi3"),
    "gemma2": dict(kind="llama", family="gemma2"),                     # add_space_prefix false
    "mistral-no-space-prefix": dict(kind="llama", family="mistral", add_space_prefix=False),
    "gemma2-space-prefix": dict(kind="llama", family="gemma2", add_space_prefix=True),
    "mistral-add-eos": dict(kind="llama", family="mistral", add_eos=True),
    "phi3-user-defined": dict(kind="llama", family="phi3", user_defined=["<tool>", "</tool>"]),
}
LLAMA_CASES = [c for c, a in CASES.items() if a["kind"] == "llama"]
# the tokens matched whole in the text, before any other tokenization (llama.cpp's special tokens)
SPECIAL_TYPES = (ggufmodels.CONTROL, ggufmodels.USER_DEFINED, ggufmodels.UNKNOWN)


def space_prefix(args):
    if args["kind"] != "llama":
        return False
    default = ggufmodels.FAMILIES[args["family"]].get("space_prefix")
    return default if args.get("add_space_prefix") is None else args["add_space_prefix"]


def write_tokenizer_file(path, arch, **args):
    """A GGUF file holding only a tokenizer and the few hyperparameters transformers reads."""
    w = gguf.GGUFWriter(path, arch)
    info = ggufmodels.add_tokenizer(w, **args)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(16)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return info


def reference_arch(args):
    if args["kind"] == "gpt2":
        return args["family"]
    return "phi3" if space_prefix(args) else "gemma2"


class Built:
    def __init__(self, ours, ref, info, path):
        self.ours, self.ref, self.info, self.path = ours, ref, info, path

    def specials(self):
        return [t for t, ty in zip(self.info.tokens, self.info.types) if ty in SPECIAL_TYPES]

    def texts(self):
        """TEXTS, and text around every control and user-defined token of the vocabulary."""
        extra = []
        for s in self.specials():
            extra += [s, s + "hello", "hello " + s + " world", " " + s + "x" + s + " ", s + s + "\n" + s]
        return TEXTS + extra


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cache = {}

    def get(case, arch=None, **more):
        key = (case, arch, repr(sorted(more.items())))
        if key not in cache:
            args = dict(CASES[case], **more)
            d = tmp_path_factory.mktemp(case)
            info = write_tokenizer_file(str(d / "t.gguf"), arch or reference_arch(args), **args)
            ref = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="t.gguf")
            cache[key] = Built(Tokenizer.from_gguf(str(d / "t.gguf")), ref, info, str(d / "t.gguf"))
        return cache[key]
    return get


def mismatches(pairs):
    return ["%r: ours %r, reference %r" % (t, a, b) for t, a, b in pairs if a != b]


# ------------------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("case", list(CASES))
def test_encode_matches_transformers(built, case):
    b = built(case)
    assert not mismatches((t, b.ours.encode(t, add_bos=False, add_eos=False),
                           b.ref(t, add_special_tokens=False).input_ids) for t in b.texts())


@pytest.mark.parametrize("case", list(CASES))
def test_bos_eos_flags_match_transformers(built, case):
    """encode's defaults are the file's add_bos/add_eos flags, as transformers' special tokens are."""
    b = built(case)
    assert not mismatches((t, b.ours.encode(t), b.ref(t).input_ids) for t in TEXTS[:6])


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_transformers_and_round_trips(built, case):
    b = built(case)
    rows = []
    for t in b.texts():
        ids = b.ours.encode(t)
        for skip in (False, True):
            rows.append(((t, skip), b.ours.decode(ids, skip_special=skip), b.ref.decode(ids, skip_special_tokens=skip)))
        # a space marker written in the text decodes as a space; a space is put after special tokens
        if "\u2581" not in t and not any(s in t for s in b.specials()):
            rows.append(((t, "round trip"), b.ours.decode(b.ours.encode(t, add_bos=False, add_eos=False)), t))
    assert not mismatches(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_chat_template_matches_transformers(built, case):
    b = built(case)
    chat = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
            {"role": "user", "content": " café 🙂\nthanks "}]
    prompt = b.ours.apply_chat_template(chat)
    assert prompt == b.ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert b.ours.encode(prompt, add_bos=False, add_eos=False) == b.ref(prompt, add_special_tokens=False).input_ids


def test_pre_tokenizer_matters(built):
    """The files of one vocabulary with the Qwen2, Llama-3 and GPT-2 splits tokenize digits and
    spaces apart (so the tests above can tell the splits apart)."""
    text = "x10 y100 z2023 w10100 2023"
    ids = {c: built(c).ours.encode(text) for c in ("qwen2", "gpt2-pre-llama-bpe", "gpt2-pre-gpt2")}
    assert len({tuple(v) for v in ids.values()}) == 3, ids
    assert built("gpt2-no-pre").ours.encode(text) == ids["gpt2-pre-gpt2"]


def test_unknown_characters_without_byte_tokens(built):
    """A character that is no piece and has no byte tokens is the unknown token (runs of them one
    token, as transformers fuses them).  Against the gemma2 builder: transformers' llama/phi3
    builders give their BPE no unknown token and drop such characters instead."""
    b = built("gemma2", byte_tokens=False)
    texts = ["emoji 🙂🙂 and 中文 x", "café", "Zürich"] + TEXTS
    assert not mismatches((t, b.ours.encode(t, add_bos=False), b.ref(t, add_special_tokens=False).input_ids)
                          for t in texts)
    assert b.info.unk_id in b.ours.encode("🙂")


def test_transformers_llama_builder_agrees_on_plain_text(built):
    """transformers' builder for architecture llama (Metaspace, prepend_scheme "first") agrees with
    llama.cpp on text that starts with no space and holds no special token.  It differs elsewhere:
    llama.cpp puts a space before each stretch of text even when it starts with one, and after
    every special token (llama-vocab.cpp, the SPM branch of tokenize); kvsimd follows llama.cpp
    (checked against the phi3 builder above and llama_cpp_spm below)."""
    b = built("mistral", arch="llama")
    texts = [t for t in TEXTS if t[:1] not in (" ", "\t", "\u2581") and t]
    assert not mismatches((t, b.ours.encode(t, add_bos=False), b.ref(t, add_special_tokens=False).input_ids)
                          for t in texts)


# ------------------------------------------------------------------------------ against llama.cpp's algorithm
def llama_cpp_spm(text, tokens, scores, types, add_space_prefix):
    """llama.cpp's SentencePiece tokenization: the text is cut at control, user-defined and unknown
    tokens (longest first); a stretch of text that starts the text or follows such a token gets a space in
    front when add_space_prefix; spaces become U+2581; then the characters are joined pairwise, each
    time the adjacent pair whose join is the vocabulary token of the highest score (leftmost of
    equals); a character left that is not a token becomes its UTF-8 byte tokens <0xAB>."""
    index = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, ty in zip(tokens, types) if ty in SPECIAL_TYPES), key=len, reverse=True)
    parts, raw, i = [], "", 0
    while i < len(text):
        s = next((s for s in specials if text.startswith(s, i)), None)
        if s is None:
            raw += text[i]
            i += 1
            continue
        if raw:
            parts.append((False, raw))
            raw = ""
        parts.append((True, s))
        i += len(s)
    if raw:
        parts.append((False, raw))
    out, after_special = [], True
    for special, s in parts:
        if special:
            out.append(index[s])
            after_special = True
            continue
        if add_space_prefix and after_special:
            s = " " + s
        after_special = False
        syms = list(s.replace(" ", "\u2581"))
        while True:
            best = None
            for j in range(len(syms) - 1):
                k = index.get(syms[j] + syms[j + 1])
                if k is not None and (best is None or scores[k] > best[0]):
                    best = (scores[k], j)
            if best is None:
                break
            j = best[1]
            syms[j:j + 2] = [syms[j] + syms[j + 1]]
        for s in syms:
            out += [index[s]] if s in index else [index["<0x%02X>" % c] for c in s.encode("utf-8")]
    return out


def spm_reference(b, text):
    return llama_cpp_spm(text, b.info.tokens, b.info.scores, b.info.types, bool(b.ours.strip_space))


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_kind_follows_llama_cpp(built, case):
    b = built(case)
    assert not mismatches((t, b.ours.encode(t, add_bos=False, add_eos=False), spm_reference(b, t))
                          for t in b.texts())


def test_merges_follow_the_scores_not_the_order_of_the_pieces(built):
    """Scores shuffled among the pieces: merges rank by score as llama.cpp's do, and as transformers'
    phi3 builder's do (its gemma builder ranks them by position in the file, which the scores of
    real Gemma files do not follow)."""
    info = built("mistral").info
    rng = np.random.default_rng(7)
    scores = list(info.scores)
    normal = [i for i, ty in enumerate(info.types) if ty == ggufmodels.NORMAL]
    for i, s in zip(normal, rng.permutation([scores[i] for i in normal])):
        scores[i] = float(s)
    b = built("mistral", meta={"tokenizer.ggml.scores": (scores, V.ARRAY)})
    b.info = b.info._replace(scores=scores)
    assert not mismatches((t, b.ours.encode(t, add_bos=False), spm_reference(b, t)) for t in b.texts())
    assert not mismatches((t, b.ours.encode(t, add_bos=False), b.ref(t, add_special_tokens=False).input_ids)
                          for t in b.texts())
    assert any(b.ours.encode(t) != built("mistral").ours.encode(t) for t in TEXTS)


def test_user_defined_whitespace_tokens_follow_llama_cpp(built):
    """Runs of spaces or tabs that a Gemma-style file marks user-defined are matched whole in the
    text, as llama.cpp matches them (transformers' gemma builder respells "  " as two U+2581 and
    tokenizes it as text instead)."""
    b = built("gemma2", user_defined=["<start_of_turn>", "<end_of_turn>", "  ", "    ", "\t\t"])
    texts = b.texts() + ["a  b    c\t\td", "   x", "\t\t\t"]
    assert not mismatches((t, b.ours.encode(t, add_bos=False), spm_reference(b, t)) for t in texts)
    assert b.ours.decode(b.ours.encode("a  b    c\t\td", add_bos=False)) == "a  b    c\t\td"


ALPHABET = sorted(set(ggufmodels.CORPUS) | set(" \n\t\u00e9\u00fc\u4e2d\U0001F642"))


@given(st.lists(st.one_of(st.text(alphabet=ALPHABET, max_size=12),
                          st.sampled_from(["[INST]", "[/INST]", "<s>", "</s>", "<unk>", "  ", "\u2581"])), max_size=8))
def test_llama_kind_follows_llama_cpp_on_any_text(built, parts):
    text = "".join(parts)
    for case in ("mistral", "mistral-no-space-prefix"):
        b = built(case)
        assert b.ours.encode(text, add_bos=False) == spm_reference(b, text), (case, text)


# ------------------------------------------------------------------------------ streaming
@pytest.mark.parametrize("case", ["qwen3", "mistral", "phi3", "gemma2", "gemma2-space-prefix"])
def test_stream_equals_decode(built, case):
    b = built(case)
    rng = np.random.default_rng(3)
    seqs = [b.ours.encode(t) for t in b.texts()]
    seqs += [list(rng.integers(0, b.ours.vocab_size, size=n)) for n in (1, 2, 5, 30, 30, 30)]
    for ids in seqs:
        for skip in (False, True):
            s = b.ours.stream(skip_special=skip)
            got = "".join(s.step(i) for i in ids) + s.flush()
            assert got == b.ours.decode(ids, skip_special=skip), (ids, skip)


# ------------------------------------------------------------------------------ defaults and bad metadata
def test_llama_file_without_ids_or_flags_gets_llama_cpp_defaults(tmp_path):
    """llama.cpp's defaults for a SentencePiece vocabulary: unknown 0, bos 1, eos 2, BOS added, space prefix."""
    path = str(tmp_path / "bare.gguf")
    keys = ["tokenizer.ggml.%s" % k for k in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                              "padding_token_id", "add_bos_token", "add_eos_token",
                                              "add_space_prefix")] + ["tokenizer.chat_template"]
    info = write_tokenizer_file(path, "llama", kind="llama", family="llama2", meta=dict.fromkeys(keys))
    spec = tokenizer_spec(open_gguf(path))
    assert (spec["unk_id"], spec["bos_id"], spec["eos_id"], spec["pad_id"]) == (0, 1, 2, None)
    assert spec["add_bos"] and spec["add_space_prefix"] and not spec["add_eos"]
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("the") == [1, info.tokens.index("\u2581the")]


def test_llama_kind_ignores_pre(tmp_path):
    """llama.cpp's SentencePiece tokenizer has no pre-tokenizer: whatever ``pre`` says is ignored."""
    path = str(tmp_path / "pre.gguf")
    write_tokenizer_file(path, "llama", kind="llama", family="mistral",
                         meta={"tokenizer.ggml.pre": ("default", V.STRING)})
    tok = Tokenizer.from_gguf(path)
    assert tok.decode(tok.encode("fine")) == "<s> fine" and tok.decode(tok.encode("fine"), skip_special=True) == "fine"


N_LLAMA = len(ggufmodels.tokenizer_metadata("llama")[1].tokens)
N_GPT2 = len(ggufmodels.tokenizer_metadata("gpt2")[1].tokens)
SCORES = [-float(i) for i in range(N_LLAMA)]
BAD = {
    "unknown kind": ("llama", {"tokenizer.ggml.model": ("bert", V.STRING)},
                     r"tokenizer\.ggml\.model='bert' is not supported \(supported: 'gpt2' \(byte-level BPE\), "
                     r"'llama' \(SentencePiece-style BPE\)\)"),
    "kind not a string": ("llama", {"tokenizer.ggml.model": (1, V.UINT32)},
                          r"tokenizer\.ggml\.model has type UINT32, expected a string"),
    "scores missing": ("llama", {"tokenizer.ggml.scores": None}, r"tokenizer\.ggml\.scores is missing"),
    "scores too short": ("llama", {"tokenizer.ggml.scores": (SCORES[:-1], V.ARRAY)},
                         r"tokenizer\.ggml\.scores has %d entries for %d tokens" % (N_LLAMA - 1, N_LLAMA)),
    "scores too long (gpt2)": ("gpt2", {"tokenizer.ggml.scores": ([0.0] * (N_GPT2 + 1), V.ARRAY)},
                               r"tokenizer\.ggml\.scores has %d entries for %d tokens" % (N_GPT2 + 1, N_GPT2)),
    "scores integers": ("llama", {"tokenizer.ggml.scores": (list(range(N_LLAMA)), V.ARRAY)},
                        r"tokenizer\.ggml\.scores has type ARRAY\[INT32\], expected an array of floats"),
    "scores strings": ("llama", {"tokenizer.ggml.scores": (["0"] * N_LLAMA, V.ARRAY)},
                       r"tokenizer\.ggml\.scores has type ARRAY\[STRING\]"),
    "scores one float": ("llama", {"tokenizer.ggml.scores": (0.5, V.FLOAT32)},
                         r"tokenizer\.ggml\.scores has type FLOAT32"),
    "score nan": ("llama", {"tokenizer.ggml.scores": (SCORES[:5] + [float("nan")] + SCORES[6:], V.ARRAY)},
                  r"tokenizer\.ggml\.scores\[5\]=nan: must be finite"),
    "score -inf": ("llama", {"tokenizer.ggml.scores": (SCORES[:-1] + [float("-inf")], V.ARRAY)},
                   r"tokenizer\.ggml\.scores\[%d\]=-inf" % (N_LLAMA - 1)),
    "unknown pre": ("gpt2", {"tokenizer.ggml.pre": ("tekken", V.STRING)},
                    r"tokenizer\.ggml\.pre='tekken' is not supported for tokenizer\.ggml\.model='gpt2' "
                    r"\(supported: 'gpt2', 'smollm', 'qwen2', .*'llama-bpe'"),
    "pre not a string": ("gpt2", {"tokenizer.ggml.pre": (2, V.UINT32)},
                         r"tokenizer\.ggml\.pre has type UINT32, expected a string"),
    "add_space_prefix not a bool": ("llama", {"tokenizer.ggml.add_space_prefix": (1, V.UINT8)},
                                    r"tokenizer\.ggml\.add_space_prefix has type UINT8, expected a bool"),
    "add_eos not a bool": ("gpt2", {"tokenizer.ggml.add_eos_token": ("yes", V.STRING)},
                           r"tokenizer\.ggml\.add_eos_token has type STRING, expected a bool"),
    "unknown id out of range": ("llama", {"tokenizer.ggml.unknown_token_id": (N_LLAMA, V.UINT32)},
                                r"tokenizer\.ggml\.unknown_token_id=%d: must be in \[0, %d\]" % (N_LLAMA, N_LLAMA - 1)),
    "padding id negative": ("gpt2", {"tokenizer.ggml.padding_token_id": (-1, V.INT32)},
                            r"tokenizer\.ggml\.padding_token_id=-1: must be in \[0, %d\]" % (N_GPT2 - 1)),
    "padding id a float": ("llama", {"tokenizer.ggml.padding_token_id": (1.0, V.FLOAT32)},
                           r"tokenizer\.ggml\.padding_token_id has type FLOAT32, expected an integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_tokenizer_metadata_is_a_gguf_error(tmp_path, case):
    kind, meta, message = BAD[case]
    path = str(tmp_path / "bad.gguf")
    write_tokenizer_file(path, "llama" if kind == "llama" else "qwen2", kind=kind, meta=meta)
    with pytest.raises(GGUFError, match=message) as e:
        Tokenizer.from_gguf(path)
    assert path in str(e.value)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3"])
def test_a_model_file_with_each_kind_of_tokenizer_loads(tmp_path, family):
    """A whole (tiny, llama-architecture) model with the family's tokenizer: the config takes the
    file's bos/eos ids and the decoder's tokenizer is the one above."""
    from test_gguf import write_llama_gguf
    from kvsimd import Decoder
    kind = ggufmodels.FAMILIES[family]["kind"]
    kv, info = ggufmodels.tokenizer_metadata(kind, family)
    drop = {k: None for k in ("tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id")}   # test_gguf's toy ones
    path = str(tmp_path / "m.gguf")
    write_llama_gguf(path, vocab=len(info.tokens), meta=dict(drop, **kv))
    m = Decoder.from_gguf(path)
    assert (m.cfg.bos_token_id, m.cfg.eos_token_id) == (info.bos_id, info.eos_id)
    ids = m.tokenizer.encode("Hello world")
    assert m.tokenizer.decode(ids, skip_special=True) == "Hello world"
    assert len(list(m.generate(ids, max_new_tokens=3))) == 3
