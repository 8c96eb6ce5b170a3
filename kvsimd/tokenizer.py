"""Tokenizer from a GGUF file's own metadata, through the ``tokenizers`` library.

GGUF stores a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) as its token list and merge
list; control tokens (type 3) are the special tokens.  The chat template is rendered with
jinja2, as transformers does.
"""
from __future__ import annotations

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
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos)
        except KVSimdError:    # the template's own raise_exception()
            raise
        except Exception as e:  # jinja2's errors (a message without "content"...) or the template's own
            raise KVSimdValueError("chat template: %s: %s (messages=%r)" % (type(e).__name__, e, messages)) from None


def _compile_template(source):
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

    def raise_exception(msg):
        raise KVSimdValueError("chat template: %s" % msg)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise KVSimdValueError("not a valid jinja2 template: %s" % e) from None

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
