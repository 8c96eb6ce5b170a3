"""Tokenizer from a GGUF file's own metadata, through the ``tokenizers`` library.

GGUF stores a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) as its token list and merge
list; control tokens (type 3) are the special tokens.  The chat template is rendered with
jinja2, as transformers does.
"""
from __future__ import annotations

from kvsimd.errors import KVSimdValueError

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

    @classmethod
    def from_gguf(cls, reader):
        from tokenizers import AddedToken, Tokenizer as TK, decoders, models, pre_tokenizers

        from kvsimd.gguf_model import field
        kind = field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise KVSimdValueError("GGUF tokenizer model %r is not supported (supported: gpt2 byte-level BPE)" % kind)
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = field(reader, "tokenizer.ggml.merges") or []
        types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tk = TK(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty in (CONTROL, USER_DEFINED)]
        tk.add_special_tokens(special)
        bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
        return cls(tk, None if bos is None else int(bos), None if eos is None else int(eos),
                   field(reader, "tokenizer.chat_template"), bool(field(reader, "tokenizer.ggml.add_bos_token", False)))

    @property
    def vocab_size(self):
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_bos=None):
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special=False):
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def stream(self, skip_special=False):
        """An incremental decoder: ``step(id)`` returns the new text (or '' while a multi-byte
        character is incomplete)."""
        from tokenizers.decoders import DecodeStream
        ds = DecodeStream(skip_special_tokens=skip_special)
        tk = self.tk

        class _Stream:
            def step(self, token_id):
                return ds.step(tk, int(token_id)) or ""
        return _Stream()

    def apply_chat_template(self, messages, add_generation_prompt=True):
        if not self.chat_template:
            raise KVSimdValueError("this model has no chat template")
        import jinja2
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(msg):
            raise KVSimdValueError("chat template: %s" % msg)
        env.globals["raise_exception"] = raise_exception
        tpl = env.from_string(self.chat_template)
        bos = self.tk.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.tk.id_to_token(self.eos_id) if self.eos_id is not None else ""
        return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                          eos_token=eos)
