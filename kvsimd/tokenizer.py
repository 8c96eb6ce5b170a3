"""Tokenizer from a GGUF file's own metadata, through the ``tokenizers`` library.

GGUF stores a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) as its token list and merge
list; control tokens (type 3) are the special tokens.  The chat template is rendered with
jinja2 in its immutable sandbox, with every size bounded (see CHAT_TEMPLATE_MAX_CHARS).
"""
from __future__ import annotations

import contextvars

import numpy as np

from kvsimd.errors import KVSimdError, KVSimdTypeError, KVSimdValueError

CONTROL = 3
USER_DEFINED = 4


class Tokenizer:
    """Byte-level BPE tokenizer: ``encode``, ``decode``, streaming decode and the chat template."""

    def __init__(self, tk, bos_id=None, eos_id=None, chat_template=None, add_bos=False):
        self.tk = tk
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._n = tk.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_gguf(cls, gf):
        """The tokenizer of a GGUF file (a path, or a file parsed by :func:`kvsimd.gguf_model.open_gguf`),
        from its checked metadata (:func:`kvsimd.gguf_model.tokenizer_spec`); built once per file."""
        from kvsimd.gguf_model import GGUFError, GGUFFile, open_gguf, tokenizer_spec
        if not isinstance(gf, GGUFFile):
            gf = open_gguf(gf)
        if getattr(gf, "_tokenizer", None) is not None:
            return gf._tokenizer
        from tokenizers import AddedToken, Tokenizer as TK, decoders, models, pre_tokenizers

        spec = tokenizer_spec(gf)
        tokens = spec["tokens"]
        try:
            vocab = {t: i for i, t in enumerate(tokens)}
            pairs = [tuple(m.split(" ", 1)) for m in spec["merges"]]
            tk = TK(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tk.decoder = decoders.ByteLevel()
            tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                   for t, ty in zip(tokens, spec["types"]) if ty in (CONTROL, USER_DEFINED)])
        except Exception as e:  # the tokenizers library rejects e.g. a merge of tokens not in the vocabulary
            raise GGUFError("%s: the tokenizer metadata (tokenizer.ggml.tokens/merges/token_type) is not a valid "
                            "BPE tokenizer: %s" % (gf.path, e)) from None
        try:
            gf._tokenizer = cls(tk, spec["bos_id"], spec["eos_id"], spec["chat_template"], spec["add_bos"])
        except KVSimdValueError as e:
            raise GGUFError("%s: metadata tokenizer.chat_template: %s" % (gf.path, e)) from None
        return gf._tokenizer

    @property
    def vocab_size(self):
        return self._n

    def token_id(self, token_id):
        """``token_id`` as an int, checked: an integer in [0, vocab_size)."""
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < self._n:
            raise KVSimdValueError("token id must be an integer in [0, %d), got %r" % (self._n, token_id))
        return int(token_id)

    def encode(self, text, add_bos=None):
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
        return ids

    def decode(self, ids, skip_special=False):
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise KVSimdTypeError("ids must be a sequence of token ids, got %s" % type(ids).__name__)
        return self.tk.decode([self.token_id(t) for t in ids], skip_special_tokens=skip_special)

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
        bos = self.tk.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.tk.id_to_token(self.eos_id) if self.eos_id is not None else ""
        try:
            return _render(self._template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos)
        except KVSimdError:    # the template's own raise_exception()
            raise
        except _TemplateTooLarge as e:
            raise KVSimdValueError("the model's chat template (tokenizer.chat_template) is refused: %s (the limit "
                                   "is kvsimd.tokenizer.CHAT_TEMPLATE_MAX_CHARS)" % e) from None
        except Exception as e:  # jinja2's errors (a message without "content", the sandbox refusing an attribute...)
            raise KVSimdValueError("the model's chat template (tokenizer.chat_template) failed: %s: %s (messages=%r)"
                                   % (type(e).__name__, e, messages)) from None


#: The most characters a chat template may add to the messages' own text when it is rendered:
#: the limit of one render is this plus twice the messages' text.  A template comes from the model
#: file, so it is untrusted code: it runs in jinja2's immutable sandbox (no access to Python
#: internals, no changes to the messages), and the rendered prompt, every string or list it makes
#: (``*``, ``+``, ``%``, a call or a filter) and every integer it passes are bounded by that limit;
#: ``**`` makes at most 4096-bit integers and all ``range()`` calls of a render together at most
#: CHAT_TEMPLATE_MAX_CHARS numbers.
CHAT_TEMPLATE_MAX_CHARS = 1 << 20
_LIMIT = contextvars.ContextVar("kvsimd_chat_template_limit", default=CHAT_TEMPLATE_MAX_CHARS)


class _TemplateTooLarge(Exception):
    pass


def _sandbox():
    """A jinja2 ImmutableSandboxedEnvironment whose every size is bounded (built once per process)."""
    global _SANDBOX
    if _SANDBOX is not None:
        return _SANDBOX
    import functools
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def need_small(args, what):
        limit = _LIMIT.get()
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
                raise _TemplateTooLarge("%s with the integer %d (more than %d)" % (what, a, limit))

    def need_short(x, what):
        limit = _LIMIT.get()
        if isinstance(x, (str, bytes, list, tuple, dict)) and len(x) > limit:
            raise _TemplateTooLarge("%s makes a %s of %d items (more than %d)" % (what, type(x).__name__, len(x),
                                                                                    limit))
        return x

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**"])

        def call_binop(self, context, operator, left, right):
            limit = _LIMIT.get()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and \
                            len(seq) * n > limit:
                        raise _TemplateTooLarge("'*' makes a %s of %d items (more than %d)"
                                                % (type(seq).__name__, len(seq) * n, limit))
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                        max(left.bit_length(), 1) * right > 64 * 64:
                    raise _TemplateTooLarge("'**' makes an integer of about %d bits"
                                            % (max(left.bit_length(), 1) * right))
            elif operator == "%" and isinstance(left, str):
                need_small(right if isinstance(right, tuple) else (right,), "'%'")
            return need_short(super().call_binop(context, operator, left, right), repr(operator))

        def call(__self, __context, __obj, *args, **kwargs):
            need_small(list(args) + list(kwargs.values()), "a call")
            return need_short(super().call(__context, __obj, *args, **kwargs), "a call")

    def bounded_filter(name, f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            need_small(list(args) + list(kwargs.values()), "the filter %r" % name)
            return need_short(f(*args, **kwargs), "the filter %r" % name)
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


def _budgeted_range():
    """``range`` for one render: at most CHAT_TEMPLATE_MAX_CHARS numbers over the whole render,
    so nested loops are bounded too."""
    left = [CHAT_TEMPLATE_MAX_CHARS]

    def range_(*args):
        r = range(*args)
        left[0] -= len(r)
        if left[0] < 0:
            raise _TemplateTooLarge("range() loops over more than %d numbers in one render"
                                    % CHAT_TEMPLATE_MAX_CHARS)
        return r
    return range_


def _render(template, messages, **context):
    """Render, refusing output longer than CHAT_TEMPLATE_MAX_CHARS plus twice the messages' text."""
    own = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
    limit = CHAT_TEMPLATE_MAX_CHARS + 2 * own
    out, n = [], 0
    token = _LIMIT.set(limit)
    try:
        for chunk in template.generate(messages=messages, range=_budgeted_range(), **context):
            n += len(chunk)
            if n > limit:
                raise _TemplateTooLarge("the rendered prompt is longer than %d characters" % limit)
            out.append(chunk)
    finally:
        _LIMIT.reset(token)
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
    UTF-8 character (a character split over several byte-level tokens is held back until it is
    complete, never printed as U+FFFD halves).  At the end of a sequence ``flush()`` returns what
    is still held back (an incomplete character as U+FFFD, as ``decode`` gives it) and starts a new
    sequence; ``reset()`` starts a new sequence dropping it.  The concatenation of every ``step``
    and the final ``flush`` equals ``tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer, skip_special=False):
        self._tok = tokenizer
        self._skip = skip_special
        self.reset()

    def reset(self):
        from tokenizers.decoders import DecodeStream
        self._ds = DecodeStream(skip_special_tokens=self._skip)
        self._pending = []      # ids fed since the last text returned

    def step(self, token_id):
        token_id = self._tok.token_id(token_id)
        self._pending.append(token_id)
        text = self._ds.step(self._tok.tk, token_id) or ""
        if text:
            self._pending = []
        return text

    def flush(self):
        text = self._tok.decode(self._pending, skip_special=self._skip) if self._pending else ""
        self.reset()
        return text
