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
        """The tokenizer of a GGUF file (a path, or a file parsed by :func:`kvsimd.loaders.gguf.open_gguf`),
        from its checked metadata (:func:`kvsimd.loaders.gguf.tokenizer_spec`); built once per file."""
        from kvsimd.loaders.gguf import GGUFError, GGUFFile, open_gguf, tokenizer_spec
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
