"""Tokenizer from a GGUF file's own metadata, through the ``tokenizers`` library.

Two kinds of GGUF tokenizer (``tokenizer.ggml.model``), built as llama.cpp tokenizes them:

- "gpt2": byte-level BPE from the token and merge lists; the text is first split by the regex
  ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`).
- "llama": SentencePiece-style BPE (Llama-2, Mistral, Phi-3, Gemma).  The file has no merges: two
  pieces merge when their concatenation is a piece, the highest-scoring such piece first
  (:func:`sentencepiece_merges`).  Spaces are spelled "\u2581"; with ``add_space_prefix`` a space
  is put before the text and after every special token, and decoding drops the one at the start;
  a character that is not a piece is spelled by its UTF-8 bytes (the ``<0xAB>`` tokens).

Control and unknown tokens (types 3, 2) are special tokens; user-defined ones (type 4) are matched
whole in the text too, but decoded even with ``skip_special``.  Decoding joins the tokens' bytes
(:meth:`Tokenizer.token_bytes`) and reads them as UTF-8.  The chat template is rendered with jinja2
in its immutable sandbox, with every size bounded (see CHAT_TEMPLATE_MAX_CHARS).
"""
from __future__ import annotations

import contextvars

import numpy as np

from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4
BYTE = 6
SPACE = "\u2581"    # SentencePiece's visible space


def _split_regex(digits):
    """The split of Qwen2 and Llama-3 byte-level BPE, which differ only in the digits per chunk."""
    return (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + digits +
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


#: ``tokenizer.ggml.pre`` of a "gpt2" file -> the regex that splits the text before byte-level BPE
#: (None: GPT-2's own split, which ``ByteLevel`` has built in; also the split of a file without
#: the key).  "smollm" splits every digit apart in llama.cpp: SmolLM2's vocabulary has no piece
#: of two digits or of a space and a digit, so GPT-2's split gives the same ids.
PRE_TOKENIZERS = {
    "gpt2": None, "smollm": None,
    "qwen2": _split_regex(""), "deepseek-r1-qwen": _split_regex(""),        # Qwen2, Qwen2.5, Qwen3
    "llama-bpe": _split_regex("{1,3}"), "llama3": _split_regex("{1,3}"),   # Llama-3
}


def sentencepiece_merges(tokens, scores, types):
    """BPE merges equivalent to llama.cpp's SentencePiece tokenizer: it repeatedly joins the two
    adjacent pieces whose concatenation is the highest-scoring piece, so every split of a piece
    into two pieces is a merge ranked by the joined piece's score (ties: the lower token id).
    Control, byte and unknown tokens are never joined or joined to."""
    skip = (UNKNOWN, CONTROL, BYTE)
    pieces = {t for t, ty in zip(tokens, types) if ty not in skip}
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] in skip:
            continue
        for k in range(1, len(t)):
            if t[:k] in pieces and t[k:] in pieces:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def _build(spec):
    """The ``tokenizers`` pipeline that encodes for a checked :func:`kvsimd.loaders.gguf.tokenizer_spec`
    (decoding is :meth:`Tokenizer.token_bytes`)."""
    from tokenizers import AddedToken, Regex, Tokenizer as TK, models, normalizers, pre_tokenizers
    tokens, types = spec["tokens"], spec["types"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if spec["kind"] == "gpt2":
        tk = TK(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in spec["merges"]], fuse_unk=False,
                           byte_fallback=False))
        split = PRE_TOKENIZERS.get(spec["pre"] or "gpt2")
        if split is None:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    else:   # "llama": each stretch of text between special tokens is one word, as in llama.cpp
        unk = tokens[spec["unk_id"]] if spec["unk_id"] is not None else None
        tk = TK(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, spec["scores"], types), unk_token=unk,
                           fuse_unk=True, byte_fallback=True))
        spaces = normalizers.Replace(" ", SPACE)
        tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if spec["add_space_prefix"] \
            else spaces
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tk


def _gpt2_bytes():
    """GPT-2's spelling of bytes as characters, reversed: character -> byte.  Printable Latin-1
    bytes are spelled as themselves, the other 68 bytes as U+0100, U+0101, ... in byte order."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or (0xA1 <= b <= 0xFF and b != 0xAD)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + k): b for k, b in enumerate(others)})
    return table


_BYTE_OF = _gpt2_bytes()


def _token_bytes(kind, token, ty):
    """The bytes a token stands for: "gpt2": its characters mapped back to bytes (a token with a
    character outside that alphabet, e.g. a special token, as its UTF-8); "llama": a byte token
    <0xAB> its byte, a piece its text with U+2581 as a space, a special token its text."""
    if kind == "gpt2":
        try:
            return bytes([_BYTE_OF[c] for c in token])
        except KeyError:
            return token.encode("utf-8")
    if ty == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    if ty in (CONTROL, USER_DEFINED, UNKNOWN):
        return token.encode("utf-8")
    return token.replace(SPACE, " ").encode("utf-8")


class Tokenizer:
    """A GGUF file's tokenizer (from :meth:`from_gguf`): ``encode``, ``decode``, streaming decode
    and the chat template.  ``tk`` is the ``tokenizers`` pipeline that encodes; ``spec`` the
    checked metadata (:func:`kvsimd.loaders.gguf.tokenizer_spec`)."""

    def __init__(self, tk, spec):
        self.tk = tk
        self.kind = spec["kind"]
        self.bos_id, self.eos_id = spec["bos_id"], spec["eos_id"]
        self.unk_id, self.pad_id = spec["unk_id"], spec["pad_id"]
        self.chat_template = spec["chat_template"]
        self.add_bos, self.add_eos = spec["add_bos"], spec["add_eos"]
        # decoding drops the space encoding put before the text
        self.strip_space = self.kind == "llama" and spec["add_space_prefix"]
        self._tokens, self._types = spec["tokens"], spec["types"]
        self._bytes = [None] * len(self._tokens)     # each token's bytes, when first decoded
        self._n = len(self._tokens)
        self._template = _compile_template(self.chat_template) if self.chat_template else None

    @classmethod
    def from_gguf(cls, gf):
        """The tokenizer of a GGUF file (a path, or a file parsed by :func:`kvsimd.loaders.gguf.open_gguf`),
        from its checked metadata (:func:`kvsimd.loaders.gguf.tokenizer_spec`); built once per file."""
        from kvsimd.loaders.gguf import GGUFError, GGUFFile, open_gguf, tokenizer_spec
        if not isinstance(gf, GGUFFile):
            gf = open_gguf(gf)
        if getattr(gf, "_tokenizer", None) is not None:
            return gf._tokenizer
        spec = tokenizer_spec(gf)
        try:
            tk = _build(spec)
        except Exception as e:  # the tokenizers library rejects e.g. a merge of tokens not in the vocabulary
            raise GGUFError("%s: the tokenizer metadata (tokenizer.ggml.tokens/merges/token_type) is not a valid "
                            "BPE tokenizer: %s" % (gf.path, e)) from None
        try:
            gf._tokenizer = cls(tk, spec)
        except KVSimdValueError as e:
            raise GGUFError("%s: metadata tokenizer.chat_template: %s" % (gf.path, e)) from None
        return gf._tokenizer

    def token_bytes(self, token_id, skip_special=False):
        """The bytes token ``token_id`` stands for (its text for a special token, nothing for a
        control or unknown token with ``skip_special``)."""
        i = self.token_id(token_id)
        ty = self._types[i]
        if skip_special and ty in (CONTROL, UNKNOWN):
            return b""
        b = self._bytes[i]
        if b is None:
            b = self._bytes[i] = _token_bytes(self.kind, self._tokens[i], ty)
        return b

    @property
    def vocab_size(self):
        return self._n

    def token_id(self, token_id):
        """``token_id`` as an int, checked: an integer in [0, vocab_size)."""
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < self._n:
            raise KVSimdValueError("token id must be an integer in [0, %d), got %r" % (self._n, token_id))
        return int(token_id)

    def encode(self, text, add_bos=None, add_eos=None):
        """Token ids of ``text`` (special tokens written in it are matched); BOS first and EOS last
        when ``add_bos``/``add_eos`` (default: the file's flags) and the file has those ids."""
        if not isinstance(text, str):
            raise KVSimdTypeError("text must be a str, got %s" % type(text).__name__)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate, e.g. from a surrogateescape'd non-UTF-8 byte
            raise KVSimdValueError("text must be valid Unicode (encodable as UTF-8), got %s: %s at index %d"
                                   % (_short_repr(text), "lone surrogate U+%04X" % ord(text[e.start]), e.start)) \
                from None
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids, skip_special=False):
        """The text of ``ids``: their bytes as UTF-8, a byte that starts no valid character as U+FFFD."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise KVSimdTypeError("ids must be a sequence of token ids, got %s" % type(ids).__name__)
        data = b"".join([self.token_bytes(t, skip_special) for t in ids])
        return self._lead(data.decode("utf-8", "replace"))

    def _lead(self, text):
        """``text`` that starts a sequence, without the space prefix encoding put there."""
        return text[1:] if self.strip_space and text[:1] == " " else text

    def stream(self, skip_special=False):
        """A streaming detokenizer for one sequence (see :class:`TextStream`): ``step(id)`` returns
        the text that token completes, ``flush()`` what is still pending at the end."""
        return TextStream(self, skip_special)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        """The model's chat template rendered for ``messages`` (a list of {"role", "content"} dicts)."""
        if self._template is None:
            raise KVSimdValueError("this model has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise KVSimdTypeError("messages must be a list of dicts like {'role': 'user', 'content': '...'}, got %r"
                                  % (messages,))
        bos = self._tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self._tokens[self.eos_id] if self.eos_id is not None else ""
        try:
            return _render(self._template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos)
        except KVSimdError:    # the template's own raise_exception()
            raise
        except _TemplateTooLarge as e:
            raise KVSimdValueError("the model's chat template (tokenizer.chat_template) is refused: %s (the limit "
                                   "is kvsimd.loaders.tokenizer.CHAT_TEMPLATE_MAX_CHARS)" % e) from None
        except Exception as e:  # jinja2's errors (a message without "content", the sandbox refusing an attribute...)
            raise KVSimdValueError("the model's chat template (tokenizer.chat_template) failed: %s: %s (messages=%r)"
                                   % (type(e).__name__, e, messages)) from None


#: The most characters a chat template may add to the messages' own text when it is rendered.
#: A template comes from the model file, so it is untrusted code: it runs in jinja2's immutable
#: sandbox (no access to Python internals, no changes to the messages), and one render is bounded
#: by ``limit`` = CHAT_TEMPLATE_MAX_CHARS + 2 x the messages' text: the rendered prompt, every
#: string or list it makes (``*``, ``+``, ``~``, ``%``, a call, a filter) and every integer it passes
#: are at most ``limit``; ``**`` makes integers of at most 4096 bits; and its work (loop iterations
#: plus the items of every value those operations make) is at most CHAT_TEMPLATE_WORK x ``limit``.
CHAT_TEMPLATE_MAX_CHARS = 1 << 20
CHAT_TEMPLATE_WORK = 8


class _TemplateTooLarge(Exception):
    pass


class _Budget:
    """The bounds of one render (see CHAT_TEMPLATE_MAX_CHARS)."""

    def __init__(self, limit):
        self.limit = limit
        self.work = CHAT_TEMPLATE_WORK * limit

    def charge(self, n):
        self.work -= n
        if self.work < 0:
            raise _TemplateTooLarge("the template does more than %d units of work (loop iterations plus items made)"
                                    % (CHAT_TEMPLATE_WORK * self.limit))

    def small(self, args, what):
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limit:
                raise _TemplateTooLarge("%s with the integer %d (more than %d)" % (what, a, self.limit))

    def before(self, name, vals, kwargs, what, method):
        """Refuse, before it runs, a call or filter ``name`` whose result would pass the limit:
        every integer argument is at most ``limit`` and the operations that multiply sizes
        (replace, indent, join, sum, expandtabs, wordwrap) are estimated first.  ``vals`` is the
        string/list the call works on followed by its other arguments."""
        self.small(list(vals) + list(kwargs.values()), what)
        vals = [v for v in vals if not _is_jinja_object(v)]
        if not vals:
            return
        s, rest, n = vals[0], vals[1:], None
        arg = lambda i, key, default: kwargs.get(key, rest[i] if len(rest) > i else default)
        size = lambda x: len(x) if isinstance(x, (str, list, tuple, dict)) else 1
        if name == "replace" and isinstance(s, str) and len(rest) >= 2:
            old, new = str(rest[0]), str(rest[1])
            n = len(s) + (s.count(old) if old else len(s) + 1) * len(new)
        elif name == "indent" and isinstance(s, str):
            width = arg(0, "width", 4)
            n = len(s) + (s.count("\n") + 1) * size(width) * (1 if isinstance(width, str) else max(width, 0))
        elif name == "join" and isinstance(s, str if method else (list, tuple, str)):
            seq, sep = (rest[0] if rest else (), s) if method else (s, arg(0, "d", ""))
            if isinstance(seq, (list, tuple, str)):
                n = len(seq) * size(sep) + sum(size(x) for x in seq)
        elif name == "sum" and isinstance(s, (list, tuple)):
            n = sum(size(x) for x in s)
        elif name == "expandtabs" and isinstance(s, str):
            n = len(s) + s.count("\t") * max(arg(0, "tabsize", 8), 0)
        elif name == "wordwrap" and isinstance(s, str):
            n = len(s) * (1 + size(arg(3, "wrapstring", None) or "\n"))
        if n is not None and n > self.limit:
            raise _TemplateTooLarge("%s would make %d items (more than %d)" % (what, n, self.limit))

    def short(self, x, what):
        n = len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 1
        if n > self.limit:
            raise _TemplateTooLarge("%s makes a %s of %d items (more than %d)" % (what, type(x).__name__, n,
                                                                                    self.limit))
        self.charge(n)
        return x

    def iterate(self, iterable):
        for x in iterable:
            self.charge(1)
            yield x


def _is_jinja_object(v):
    # the environment, context or eval context jinja2 passes a filter first
    return any(c.__module__.startswith("jinja2.") for c in type(v).__mro__[:-1])


_BUDGET = contextvars.ContextVar("kvsimd_chat_template_budget", default=_Budget(CHAT_TEMPLATE_MAX_CHARS))


def _sandbox():
    """A jinja2 ImmutableSandboxedEnvironment whose every size is bounded (built once per process)."""
    global _SANDBOX
    if _SANDBOX is not None:
        return _SANDBOX
    import functools
    import jinja2
    import jinja2.compiler
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(jinja2.compiler.CodeGenerator):
        """``a ~ b`` (which the sandbox does not intercept) checked like the operators, and every
        ``{% for %}`` iteration charged to the render's work."""
        def visit_Concat(self, node, frame):
            self.write("environment.kvsimd_short(")
            super().visit_Concat(node, frame)
            self.write(", '~')")

        def visit_For(self, node, frame):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("kvsimd_iterate"), [node.iter], [], None, None,
                                   lineno=node.lineno)
            super().visit_For(node, frame)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**"])
        code_generator_class = Bounded

        @staticmethod
        def kvsimd_short(x, what):
            return _BUDGET.get().short(x, repr(what))

        @staticmethod
        def kvsimd_iterate(iterable):
            return _BUDGET.get().iterate(iterable)

        def call_binop(self, context, operator, left, right):
            budget = _BUDGET.get()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and \
                            len(seq) * n > budget.limit:
                        raise _TemplateTooLarge("'*' makes a %s of %d items (more than %d)"
                                                % (type(seq).__name__, len(seq) * n, budget.limit))
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                        max(left.bit_length(), 1) * right > 64 * 64:
                    raise _TemplateTooLarge("'**' makes an integer of about %d bits"
                                            % (max(left.bit_length(), 1) * right))
            elif operator == "%" and isinstance(left, str):
                budget.small(right if isinstance(right, tuple) else (right,), "'%'")
            return budget.short(super().call_binop(context, operator, left, right), repr(operator))

        def call(__self, __context, __obj, *args, **kwargs):
            budget = _BUDGET.get()
            target = getattr(__obj, "__self__", None)
            method = isinstance(target, (str, list, tuple, dict))
            budget.before(getattr(__obj, "__name__", ""), ((target,) if method else ()) + args, kwargs,
                          "a call of %s" % getattr(__obj, "__name__", "?"), method)
            return budget.short(super().call(__context, __obj, *args, **kwargs), "a call")

    def bounded_filter(name, f):
        @functools.wraps(f)     # keeps jinja2's pass_context/pass_environment marks
        def g(*args, **kwargs):
            budget = _BUDGET.get()
            budget.before(name, args, kwargs, "the filter %r" % name, False)
            return budget.short(f(*args, **kwargs), "the filter %r" % name)
        return g

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters = {k: bounded_filter(k, f) for k, f in env.filters.items()}
    del env.globals["lipsum"]

    def raise_exception(msg):
        raise KVSimdValueError("chat template: %s" % msg)
    env.globals["raise_exception"] = raise_exception
    _SANDBOX = env
    return env


_SANDBOX = None


def _render(template, messages, **context):
    """Render within the bounds of CHAT_TEMPLATE_MAX_CHARS."""
    own = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
    budget = _Budget(CHAT_TEMPLATE_MAX_CHARS + 2 * own)
    out, n = [], 0
    token = _BUDGET.set(budget)
    try:
        for chunk in template.generate(messages=messages, **context):
            n += len(chunk)
            if n > budget.limit:
                raise _TemplateTooLarge("the rendered prompt is longer than %d characters" % budget.limit)
            out.append(chunk)
    finally:
        _BUDGET.reset(token)
    return "".join(out)


def _compile_template(source):
    import jinja2
    try:
        return _sandbox().from_string(source)
    except jinja2.TemplateError as e:
        raise KVSimdValueError("not a valid jinja2 template: %s" % e) from None


def _short_repr(text, n=60):
    return repr(text) if len(text) <= n else "%r... (%d characters)" % (text[:n], len(text))


class TextStream:
    """Incremental decoding of one sequence of token ids.

    ``step(id)`` returns the new text, or ``''`` while the bytes so far end inside a multi-byte
    UTF-8 character (a character split over several tokens is held back until it is complete,
    never printed as U+FFFD halves).  At the end of a sequence ``flush()`` returns what is still
    held back (an incomplete character as U+FFFD, as ``decode`` gives it) and starts a new
    sequence; ``reset()`` starts a new sequence dropping it.  The concatenation of every ``step``
    and the final ``flush`` equals ``tokenizer.decode(ids)``: both decode the same bytes, one
    with Python's incremental UTF-8 decoder.
    """

    def __init__(self, tokenizer, skip_special=False):
        self._tok = tokenizer
        self._skip = skip_special
        self.reset()

    def reset(self):
        import codecs
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._start = True      # no text returned yet: the space prefix is still to drop

    def step(self, token_id):
        return self._first(self._utf8.decode(self._tok.token_bytes(token_id, self._skip)))

    def flush(self):
        text = self._first(self._utf8.decode(b"", final=True))
        self.reset()
        return text

    def _first(self, text):
        if text and self._start:
            self._start = False
            return self._tok._lead(text)
        return text
