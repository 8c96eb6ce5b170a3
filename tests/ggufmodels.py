"""Tiny GGUF tokenizers of each model family, for test files written with ``gguf.GGUFWriter``.

:func:`add_tokenizer` writes a tokenizer's metadata (:func:`tokenizer_metadata`) into a writer:
a vocabulary of a few hundred pieces learnt here by plain BPE from :data:`CORPUS` (deterministic),
the family's special tokens and a chat template in the family's format.  The writer's architecture
and model tensors are the caller's; the embedding has ``len(info.tokens)`` rows.

- kind "gpt2" (qwen2, qwen3): byte-level BPE, the 256 byte characters, merges, ``tokenizer.ggml.pre``.
- kind "llama" (mistral, llama2, phi3, gemma2): SentencePiece-style, laid out as llama.cpp's
  converter writes one: control tokens, ``<0x00>``..``<0xFF>`` byte tokens, learnt pieces scored
  -rank (spaces spelled U+2581), single characters scored below every piece, no merges.
"""
import collections
import re
from typing import NamedTuple

import gguf

T = gguf.GGUFValueType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.
Once upon a time there was a little house by the river, and in the house there lived an old man
with his three daughters. Every morning the old man walked to the market to sell bread and cheese.
"Hello, world!" said the program. It printed the numbers 1, 2, 3, 10, 42, 100 and 2024 in a loop:
for i in range(10): print(i * 2)   # comments start with a hash
def add(a, b):
    return a + b
Naive cafe owners in Zurich serve creme brulee: the cafe is the best in town, they say.
Weather today: sunny, 23 degrees; tomorrow: rain. Don't forget your umbrella! We'll see, won't we?
Questions and answers: what is the capital of France? Paris. What is two plus two? Four.
Version 10.100.2023 came out on 2023-10-10 at 10:10; it is 100x faster, 10x smaller (2023/10/10).
Thinking step by step helps the model answer questions about numbers, words and code.
"""

# family -> (kind, special tokens before the vocabulary, after it, chat template, defaults)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAMILIES = {
    "qwen2": dict(kind="gpt2", after=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], user=[],
                  ids=dict(bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>"), template=CHATML,
                  add_bos=False, pre="qwen2"),
    "qwen3": dict(kind="gpt2", after=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], user=["<think>", "</think>"],
                  ids=dict(bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>"), template=CHATML,
                  add_bos=False, pre="qwen2"),
    "mistral": dict(kind="llama", before=["<unk>", "<s>", "</s>"], after=["[INST]", "[/INST]"], user=[],
                    ids=dict(unk="<unk>", bos="<s>", eos="</s>"), add_bos=True, space_prefix=True,
                    template="{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}"
                             " [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"),
    "llama2": dict(kind="llama", before=["<unk>", "<s>", "</s>"], after=[], user=[],
                   ids=dict(unk="<unk>", bos="<s>", eos="</s>"), add_bos=True, space_prefix=True,
                   template="{% for m in messages %}{% if m.role == 'user' %}{{ bos_token }}[INST] {{ m.content }}"
                            " [/INST]{% else %} {{ m.content }} {{ eos_token }}{% endif %}{% endfor %}"),
    "phi3": dict(kind="llama", before=["<unk>", "<s>", "</s>"],
                 after=["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"], user=[],
                 ids=dict(unk="<unk>", bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>"), add_bos=False,
                 space_prefix=True,
                 template="{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "gemma2": dict(kind="llama", before=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], after=[],
                   user=["<start_of_turn>", "<end_of_turn>"],
                   ids=dict(pad="<pad>", eos="<eos>", bos="<bos>", unk="<unk>"), add_bos=True, space_prefix=False,
                   template="{{ bos_token }}{% for m in messages %}<start_of_turn>"
                            "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
                            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
DEFAULT_FAMILY = {"gpt2": "qwen2", "llama": "mistral"}


class TokenizerInfo(NamedTuple):
    """What :func:`add_tokenizer` wrote: ``tokens`` (the vocabulary, by id), ``types``, ``scores``
    ("llama") or ``merges`` ("gpt2"), and the special ids (None where the family has none)."""
    kind: str
    family: str
    tokens: list
    types: list
    scores: list
    merges: list
    bos_id: object
    eos_id: object
    unk_id: object
    pad_id: object
    chat_template: str


def _train(words, n_merges):
    """Plain BPE: ``words`` (a Counter of symbol tuples) merged ``n_merges`` times, the most frequent
    adjacent pair first (ties: the larger pair).  Returns the merges in order."""
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        joined = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            joined[tuple(out)] += c
        words = joined
    return merges


def byte_alphabet():
    """GPT-2's byte -> character spelling: printable Latin-1 bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    spell, extra = {}, 0
    for b in range(256):
        if b in keep:
            spell[b] = chr(b)
        else:
            spell[b] = chr(0x100 + extra)
            extra += 1
    return spell


def _pieces_unique(merges):
    seen, out = set(), []
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            out.append(a + b)
    return out


def add_tokenizer(writer, kind, family=None, **options):
    """Write a small tokenizer of ``kind`` ("gpt2" or "llama") and ``family`` into ``writer`` (a
    ``gguf.GGUFWriter``); ``options`` as :func:`tokenizer_metadata`'s.  Returns a :class:`TokenizerInfo`."""
    kv, info = tokenizer_metadata(kind, family, **options)
    for key, v in kv.items():
        writer.add_key_value(key, *v)
    return info


def tokenizer_metadata(kind, family=None, n_merges=300, add_space_prefix=None, pre=None, chat_template=None,
                       add_bos=None, add_eos=None, user_defined=None, byte_tokens=True, meta=None, corpus=CORPUS):
    """The metadata of a small tokenizer of ``kind`` ("gpt2" or "llama") and ``family`` (qwen2, qwen3
    for gpt2; mistral, llama2, phi3, gemma2 for llama), as key -> (value, ``gguf.GGUFValueType``)
    (what ``GGUFWriter.add_key_value`` takes), and its :class:`TokenizerInfo`; the other
    arguments override the family's defaults (``pre``: gpt2 only; ``add_space_prefix``: llama only,
    None leaves the key out for gpt2, and writes the family's value for llama; ``byte_tokens``: llama
    only, False leaves out the ``<0xAB>`` tokens, so a character not in the vocabulary is unknown).
    ``meta``: key -> (value, ``gguf.GGUFValueType``) written instead (None: the key left out), e.g.
    to write malformed metadata (the :class:`TokenizerInfo` is the vocabulary as learnt, before ``meta``)."""
    family = family or DEFAULT_FAMILY[kind]
    fam = FAMILIES[family]
    if fam["kind"] != kind:
        raise ValueError("family %r is of kind %r, not %r" % (family, fam["kind"], kind))
    user = list(fam["user"] if user_defined is None else user_defined)
    if kind == "gpt2":
        spell = byte_alphabet()
        words = collections.Counter(tuple(spell[b] for b in w.encode("utf-8"))
                                    for w in re.findall(r" ?[^\W\d_]+| ?\d+| ?[^\w\s]+|\s+", corpus))
        merges = _train(words, n_merges)
        normal = [spell[b] for b in range(256)] + _pieces_unique(merges)
        tokens = normal + fam["after"] + user
        types = [NORMAL] * len(normal) + [CONTROL] * len(fam["after"]) + [USER_DEFINED] * len(user)
        scores = None
    else:
        words = collections.Counter(tuple(SPACE + w) for w in corpus.split())
        merges = _train(words, n_merges)
        pieces = _pieces_unique(merges)
        chars = sorted({c for w in words for c in w} - set(pieces))
        byte_tokens = ["<0x%02X>" % b for b in range(256)] if byte_tokens else []
        tokens = fam["before"] + byte_tokens + pieces + chars + fam["after"] + user
        types = ([UNKNOWN if t == fam["ids"].get("unk") else CONTROL for t in fam["before"]] +
                 [BYTE] * len(byte_tokens) + [NORMAL] * (len(pieces) + len(chars)) +
                 [CONTROL] * len(fam["after"]) + [USER_DEFINED] * len(user))
        scores = ([0.0] * (len(fam["before"]) + len(byte_tokens)) +
                  [-float(i) for i in range(len(pieces) + len(chars))] + [0.0] * (len(fam["after"]) + len(user)))
    ids = {k: tokens.index(v) for k, v in fam["ids"].items()}
    template = fam["template"] if chat_template is None else chat_template
    K = "tokenizer.ggml."
    kv = {K + "model": (kind, T.STRING), K + "tokens": (tokens, T.ARRAY), K + "token_type": (types, T.ARRAY),
          K + "add_bos_token": (fam["add_bos"] if add_bos is None else add_bos, T.BOOL),
          K + "add_eos_token": (bool(add_eos), T.BOOL)}
    if kind == "gpt2":
        kv[K + "pre"] = (fam["pre"] if pre is None else pre, T.STRING)
        kv[K + "merges"] = (["%s %s" % m for m in merges], T.ARRAY)
    else:
        kv[K + "scores"] = (scores, T.ARRAY)
    if kind == "llama" or add_space_prefix is not None:
        kv[K + "add_space_prefix"] = (fam.get("space_prefix") if add_space_prefix is None else add_space_prefix,
                                      T.BOOL)
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if key in ids:
            kv[K + name + "_token_id"] = (ids[key], T.UINT32)
    if template:
        kv["tokenizer.chat_template"] = (template, T.STRING)
    for key, v in (meta or {}).items():
        if v is None:
            kv.pop(key, None)
        else:
            kv[key] = v
    return kv, TokenizerInfo(kind, family, tokens, types, scores,
                             ["%s %s" % m for m in merges] if kind == "gpt2" else [], ids.get("bos"),
                             ids.get("eos"), ids.get("unk"), ids.get("pad"), template)
