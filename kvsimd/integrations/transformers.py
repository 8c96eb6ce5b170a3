"""kvsimd inside Hugging Face ``transformers``: an attention backend and KV caches for ``generate``.

Importing this module registers ``attn_implementation="kvsimd"`` with transformers' attention
and attention-mask interfaces.  Two lines then give a transformers model kvsimd's attention and
its caches, without leaving the model, the tokenizer or ``generate``::

    import kvsimd.integrations.transformers as kt
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvsimd")   # or kt.enable(model)
    out = model.generate(ids, past_key_values=kt.KVSimdCache(model), max_new_tokens=64)

- :func:`attention` (the backend): every call runs :func:`kvsimd.ops.attend`, a decode step (one
  query token) as well as a prefill (T query rows, causal, in one multi-row call per sequence),
  GQA/MQA without repeating K/V, the model's ``scaling``, sliding window and soft cap, left (or
  any) padding from the 2-D attention mask.  Over a kvsimd cache it reads the cache's own storage
  (zero copy: no torch tensor is built per step); over any other cache (e.g. transformers'
  ``DynamicCache``) it reads the key/value tensors it is given, also without copying when they are
  float32 or float16 and contiguous per sequence.
- :class:`KVSimdCache`: transformers' Cache API over a :class:`kvsimd.KVCache` (float16, float32,
  int8 or int4 storage: int8 with a float32 scale per 32 values, about half the bytes a float16
  cache streams per step; int4 two values per byte with the same scales, under a third of them,
  each block of 32 values stored turned by the 32 x 32 Hadamard matrix unless ``hadamard=False``:
  the backend turns the query and the output as kvsimd's own attention does; "int8/int4": int8
  keys with int4 values, 0.44x float16's bytes at close to int8's accuracy), growing by
  doubling like ``DynamicCache``; ``crop`` (assisted / prompt-lookup decoding) truncates.
- :class:`KVSimdSinkCache`: StreamingLLM -- ``n_keep`` attention sinks and a window of recent
  tokens that never fills: the kvsimd cache's ``sink_query`` policy (no key is ever rewritten;
  the sinks are read with the query rotated to its position in the cache, the window at true
  distances).  RoPE models (Llama, Mistral, Qwen2/3, Phi-3); unpadded batches.

What is refused with a :class:`kvsimd.KVSimdError` naming it: training (dropout), non-causal
attention, 4-D or custom attention masks (packed sequences, multimodal overlays), beam search,
and a kvsimd cache under another attention implementation.  torch and transformers stay optional
dependencies of kvsimd: only this module imports them.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as _missing:   # pragma: no cover - the optional extra
    raise ImportError("kvsimd.integrations.transformers needs torch and transformers: pip install -e '.[hf]' "
                      "from the checkout (%s)" % _missing) from _missing

from kvsimd import ops
from kvsimd._kvsimd import _cache_kind, _cache_recent, _need_int
from kvsimd.cache import KVCache, RopeSpec
from kvsimd.errors import KVSimdCapacityError, KVSimdTypeError, KVSimdValueError

NAME = "kvsimd"

# kvsimd's import sets GOMP_SPINCOUNT=1000 (threads sleep soon after each OpenMP region) unless the
# user chose a spin or wait policy or torch was already loaded.  torch and kvsimd share the
# process's one libgomp, so torch's own threads then sleep between its operators too: transformers
# SmolLM2 decode at 2 threads measured 20 tok/s that way against 31 with libgomp's default.
if getattr(__import__("kvsimd"), "_SPIN_SET", False):
    warnings.warn("kvsimd was imported before torch and set GOMP_SPINCOUNT=1000 for the process's OpenMP, which "
                  "torch shares: torch's threads now sleep between operators (slower with 2+ threads).  Import "
                  "torch (or transformers) before kvsimd, or set GOMP_SPINCOUNT yourself", RuntimeWarning,
                  stacklevel=2)
#: families whose attention the sink cache knows (transformers' NeoX-layout RoPE on q and k)
SINK_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


# ---------------------------------------------------------------------------------------- backend
#: keyword arguments models pass to attention functions that do not change what attention computes
_HARMLESS = frozenset(("position_ids", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
                       "cache_position", "is_causal"))


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              softcap=None, **kwargs):
    """transformers' attention-function signature: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, Hkv, N, D]`` (the cache's, or tensors), ``attention_mask`` what :func:`attention_mask`
    made (None or a 2-D boolean ``[B, N]`` of the keys that are not padding).  Returns
    ``([B, T, H, D] in query's dtype, None)``: there are no attention weights to return."""
    if kwargs and (not _HARMLESS.issuperset(kwargs) or kwargs.get("is_causal", True) is False):
        unknown = sorted(set(kwargs) - _HARMLESS)
        raise KVSimdValueError("kvsimd attention does not apply %s, which %s passes (attention sinks, packed "
                               "sequences, non-causal attention, ...): refused rather than ignored"
                               % (", ".join("%s=%r" % (k, kwargs[k]) for k in unknown) or "is_causal=False",
                                  type(module).__name__))
    dropout, cap = _number(dropout, "dropout"), _number(softcap, "softcap")
    if dropout:
        raise KVSimdValueError("kvsimd attention runs inference only, got dropout=%r (is the model in training "
                               "mode? call model.eval())" % (dropout,))
    if not getattr(module, "is_causal", True):
        raise KVSimdValueError("kvsimd attention is causal (decoders); %s is not" % type(module).__name__)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2):
        raise KVSimdValueError("kvsimd attention takes the 2-D padding mask transformers builds for it (or None); got "
                               "%s: a 4-D or custom mask (packed sequences, multimodal overlays) is not supported"
                               % ((tuple(attention_mask.shape) if hasattr(attention_mask, "shape")
                                   else type(attention_mask).__name__),))
    if not isinstance(query, torch.Tensor) or query.ndim != 4:
        raise KVSimdValueError("query must be a [batch, heads, tokens, head_dim] tensor, got %s"
                               % (tuple(query.shape) if hasattr(query, "shape") else type(query).__name__,))
    B, H, T, D = query.shape
    if attention_mask is not None and attention_mask.shape[0] != B:
        raise KVSimdValueError("attention_mask has %d rows for a batch of %d" % (attention_mask.shape[0], B))
    q = query.detach()
    q = (q if q.dtype == torch.float32 else q.float()).numpy()
    mask = None if attention_mask is None else attention_mask.detach().to(torch.bool).numpy()
    out = np.empty((B, T, H, D), dtype=np.float32)
    window = int(sliding_window) if sliding_window else 0
    cap = cap if cap else None
    tag = getattr(key, "_kvsimd", None)
    if tag is not None:
        tag[0]._check_model(module)
        tag[0]._attend(tag[1], q, out, mask, scaling, cap, window)
    else:
        _attend_tensors(q, key, value, out, mask, scaling, cap, window)
    res = torch.from_numpy(out)
    return (res if query.dtype == torch.float32 else res.to(query.dtype)), None


def _number(x, name):
    """x (None: 0) as a float, or KVSimdTypeError naming the argument (a tensor of one element passes)."""
    if x is None:
        return 0.0
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):   # strings, tensors of several elements
        raise KVSimdTypeError("%s must be a number, got %r" % (name, x)) from None


def _kv_array(t):
    """A key/value tensor as a NumPy array kvsimd reads (float32 or float16, no copy if it is one)."""
    t = t.detach()
    if t.dtype not in (torch.float32, torch.float16):
        t = t.float()
    return t.numpy()


def _attend_tensors(q, key, value, out, mask, scale, softcap, window):
    """Attention over key/value tensors of any other cache (or of a pass without one)."""
    k, v = _kv_array(key), _kv_array(value)
    if k.dtype != v.dtype:
        v = v.astype(k.dtype)
    B, T, N = q.shape[0], q.shape[2], k.shape[2]
    if k.shape[0] != B or v.shape != k.shape:
        raise KVSimdValueError("query %s, key %s and value %s do not fit together" % (q.shape, k.shape, v.shape))
    for b in range(B):
        _attend_seq(q[b], np.ascontiguousarray(k[b]), np.ascontiguousarray(v[b]), _runs(mask, b, N), N, T, window,
                    scale, softcap, out[b])


def _runs(mask, b, N):
    """The keys 0..N-1 of sequence b that are not padding, as (t0, t1) runs."""
    if mask is None:
        return [(0, N)]
    m = mask[b, :N]
    if m.shape[0] < N:                      # keys the mask does not reach are not padding
        m = np.concatenate([m, np.ones(N - m.shape[0], dtype=bool)])
    edges = np.flatnonzero(np.diff(np.concatenate(([0], m.view(np.int8), [0]))))
    return [(int(a), int(c)) for a, c in zip(edges[::2], edges[1::2])]


def _attend_seq(qb, K, V, runs, N, T, window, scale, softcap, outb, scales=(None, None), hadamard=False,
                recent=None):
    """One sequence: qb ``[H, T, D]`` (its last T tokens are keys N-T..N-1) over the keys of
    ``runs`` in K/V ``[Hkv, >= N, D]`` (int8 / int4 rows: with ``scales``, their block scales, and
    ``hadamard`` when the rows are stored turned, see :func:`kvsimd.ops.attend`); outb
    ``[T, H, D]``.  Rows that see no key (padding before the first real token) get zeros, as no
    softmax is defined for them.  ``recent`` = (k, v, R): float rows of keys N - M..N-1, each row
    reading its last R keys from them (ops.attend's ``recent_window``)."""
    ks, vs = scales
    ov = {} if recent is None else dict(recent=recent[:2], recent_window=recent[2])
    if T == 1:
        lo = N - window if window else 0
        rr = [(max(a, lo), c) for a, c in runs if c > lo]
        if not rr:
            outb[0] = 0.0
            return
        if ov:       # the row at key N - 1, so that the float rows stand for the keys before it
            ops.attend(np.ascontiguousarray(qb[:, 0, :])[None], K, V, ranges=rr, causal_offset=N - 1, scale=scale,
                       softcap=softcap, out=outb[:1], k_scale=ks, v_scale=vs, hadamard=hadamard, **ov)
            return
        ops.attend(np.ascontiguousarray(qb[:, 0, :]), K, V, ranges=rr, scale=scale, softcap=softcap, out=outb[0],
                   k_scale=ks, v_scale=vs, hadamard=hadamard)
        return
    if window and len(runs) > 1:
        raise KVSimdValueError("a sliding window over a mask with holes (padding between real tokens) is not "
                               "supported; pad on the left")
    first = runs[0][0] if runs else N
    t0 = min(T, max(0, first - (N - T)))
    outb[:t0] = 0.0
    if t0 < T:
        qt = np.ascontiguousarray(qb[:, t0:, :].transpose(1, 0, 2))
        ops.attend(qt, K, V, ranges=runs, causal_offset=N - T + t0, window=window or None, scale=scale,
                   softcap=softcap, out=outb[t0:], k_scale=ks, v_scale=vs, hadamard=hadamard, **ov)


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, use_vmap=False, config=None, **kwargs):
    """transformers' mask-interface signature: no 4-D mask is built (the kernel applies causality
    and windows itself); returns None or the 2-D boolean padding mask of the keys."""
    sliding = getattr(config, "sliding_window", None)
    known = mask_function is causal_mask_function or (
        sliding and getattr(mask_function, "__qualname__", "").startswith("and_masks."))
    if use_vmap or (mask_function is not None and not known):
        raise KVSimdValueError("kvsimd attention applies causal masks, padding and sliding windows; this model or "
                               "call adds its own mask function %s (packed sequences, multimodal overlays), which "
                               "it does not support" % getattr(mask_function, "__qualname__", mask_function))
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        raise KVSimdValueError("the attention mask must be a 2-D tensor [batch, keys], got %s"
                               % (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                                  else type(attention_mask).__name__,))
    m = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    return None if bool(m.all()) else m


def register():
    """Register ``"kvsimd"`` with transformers' attention and attention-mask interfaces (done on
    import; idempotent)."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, attention_mask)


def enable(model):
    """Switch a loaded model to kvsimd's attention (``model.set_attn_implementation("kvsimd")``)."""
    register()
    model.set_attn_implementation(NAME)
    return model


register()


# ---------------------------------------------------------------------------------------- caches
def _config_of(model):
    c = getattr(model, "config", None)
    if c is None or not hasattr(c, "num_hidden_layers"):
        raise KVSimdTypeError("a kvsimd cache needs a loaded transformers model (with .config), got %s"
                              % type(model).__name__)
    return getattr(c, "get_text_config", lambda: c)()


class _Layer(CacheLayerMixin):
    """One layer as transformers' Cache API sees it; the storage is the owner's KVCache."""
    is_compileable = False
    is_croppable = True

    def __init__(self, owner, index):
        super().__init__()
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._update(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length):
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self):
        return self.owner.get_seq_length()

    def get_max_length(self):
        return -1

    def reset(self):
        pass


class _KVSimdCacheBase(Cache):
    """What both caches share: the KVCache, per-forward bookkeeping (layers are updated in order
    0..n-1 once per forward pass; a pass that fails half-way is undone at the start of the next),
    and the zero-copy views handed to transformers."""

    _policy = "fixed"

    def __init__(self, model, dtype="float16", hadamard=None, recent=0):
        c = _config_of(model)
        self._config = c
        self.n_layers = int(c.num_hidden_layers)
        self.n_heads = int(c.num_attention_heads)
        self.n_kv_heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        # KVCache's rule, checked now (the KVCache is made at the first pass): by default rows are
        # stored turned by H when K or V is int4
        self.dtype, kd, _, self.hadamard = _cache_kind(dtype, hadamard)
        self._quantized = kd in ("int8", "int4")
        self.recent = _cache_recent(recent, self.dtype, kd)   # KVCache's rule, checked now as well
        super().__init__(layers=[_Layer(self, i) for i in range(self.n_layers)])
        self.kv = None
        self._pending = None          # the forward pass in progress: dict, or None
        self._views = None

    # -- transformers' Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx=0):
        """Tokens every layer holds (committed; a padded batch counts its padding, as transformers does)."""
        return 0 if self.kv is None else int(self._committed())

    def get_max_length(self, layer_idx=None):
        return -1

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.get_seq_length() + query_length, 0

    def reset(self):
        self._abort()
        if self.kv is not None:
            self.kv.reset()

    def reorder_cache(self, beam_idx):
        raise KVSimdValueError("%s does not support beam search (num_beams > 1); use greedy or sampling"
                               % type(self).__name__)

    def batch_repeat_interleave(self, repeats):
        if self.get_seq_length():
            raise KVSimdValueError("%s cannot repeat its sequences (beam search / contrastive search); use greedy "
                                   "or sampling" % type(self).__name__)

    def batch_select_indices(self, indices):
        raise KVSimdValueError("%s cannot select sequences of its batch; make a new cache" % type(self).__name__)

    @property
    def is_compileable(self):
        return False

    @property
    def batch_size(self):
        return -1 if self.kv is None else self.kv.batch

    @property
    def nbytes(self):
        """Bytes of K/V storage held now."""
        return 0 if self.kv is None else self.kv.nbytes

    # -- the forward pass
    def _update(self, layer, key_states, value_states):
        if layer == 0:
            impl = getattr(self._config, "_attn_implementation", None)
            if impl != NAME:
                raise KVSimdValueError("%s stores K/V in kvsimd's own layout, read by attn_implementation='kvsimd'; "
                                       "this model runs %r: load it with attn_implementation='kvsimd' or call "
                                       "kvsimd.integrations.transformers.enable(model)" % (type(self).__name__, impl))
        if key_states.ndim != 4 or key_states.shape != value_states.shape:
            raise KVSimdValueError("key/value states must be [batch, kv_heads, tokens, head_dim], got %s and %s"
                                   % (tuple(key_states.shape), tuple(value_states.shape)))
        B, Hkv, T, D = key_states.shape
        if Hkv != self.n_kv_heads or D != self.head_dim:
            raise KVSimdValueError("key states [%d, %d, %d, %d] do not fit the cache's %d KV heads of %d dims"
                                   % (B, Hkv, T, D, self.n_kv_heads, self.head_dim))
        if layer == 0:
            self._abort()
            self._begin(B, T)
        p = self._pending
        if p is None or layer != p["next"] or B != p["B"] or T != p["T"]:
            self._abort()
            raise KVSimdValueError("%s: layer %r updated out of order (each forward pass updates layers 0..%d once, "
                                   "with the same batch and tokens)" % (type(self).__name__, layer, self.n_layers - 1))
        k, v = _kv_f32(key_states), _kv_f32(value_states)
        rows = []
        for b in range(B):
            kb, vb = np.ascontiguousarray(k[b]), np.ascontiguousarray(v[b])
            self.kv.write(layer, kb, vb, seq=b, start=p["slots"][b])
            rows.append((kb, vb))
        if self.recent:
            p["computed"] = rows      # this layer's rows as computed: the float rows its attention reads
        p["next"] = layer + 1
        kt, vt = self._views[layer]
        n = p["extent"]
        kt, vt = kt[:, :, :n], vt[:, :, :n]
        kt._kvsimd = vt._kvsimd = (self, layer)
        return kt, vt

    def _make(self, B, capacity, old=None):
        """A new KVCache (its contents those of ``old``, if given) and the torch views of it."""
        kv = KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, batch=B, dtype=self.dtype,
                     hadamard=self.hadamard, recent=self.recent, **self._streaming())
        if old is not None:
            for b in range(B):
                L = old.length(b)
                for l in range(self.n_layers):       # as stored, bit for bit
                    kv._restore_rows(l, b, 0, old._saved_rows(l, b, 0, L))
                if L:
                    kv.append(b, L)
            if self.recent:
                kv._copy_recent(old)
        self.kv = kv
        with warnings.catch_warnings():      # read-only storage: transformers' models only read what update returns
            warnings.simplefilter("ignore", UserWarning)
            self._views = [(torch.from_numpy(kv._layer_view(l, 0)), torch.from_numpy(kv._layer_view(l, 1)))
                           for l in range(self.n_layers)]
        self._blocks = [[(kv.keys(l, b, length=capacity), kv.values(l, b, length=capacity)) for b in range(B)]
                        for l in range(self.n_layers)]
        self._scales = [[(kv.key_scales(l, b, length=capacity), kv.value_scales(l, b, length=capacity))
                         if self._quantized
                         else (None, None) for b in range(B)] for l in range(self.n_layers)]
        for layer in self.layers:
            layer.is_initialized = True

    def _streaming(self):
        return {}

    def _same_batch(self, B):
        """The KVCache, or None when there is none yet or an empty one of another batch size."""
        kv = self.kv
        if kv is not None and kv.batch != B:
            if self.get_seq_length():
                raise KVSimdValueError("the cache holds %d sequences, this pass has %d: reset() it or make a new one"
                                       % (kv.batch, B))
            kv = self.kv = None
        return kv

    def _abort(self):
        self._pending = None

    def _pass_rows(self, layer, b, p):
        """(k, v, R) for _attend_seq: sequence b's float rows that this pass's rows read -- its last
        R - 1 committed ones, then the pass's own, rounded as the cache stores them -- and R, the
        cache's ``recent`` (capped at its capacity)."""
        R = self.kv.recent
        return self.kv._float_rows(layer, b, *p["computed"][b], R - 1) + (R,)

    def _step_row(self, layer, q, out, b, N, scale, softcap):
        """A decode step of sequence b over its N keys, every one: the cache's own single-query
        call (with ``recent``, its last R keys from the float rows write() just stored and the
        committed ones before them, KVCache.attend's ``float_rows``)."""
        self.kv.attend(layer, np.ascontiguousarray(q[b, :, 0, :]), seq=b, length=N, scale=scale, softcap=softcap,
                       out=out[b, 0], float_rows=bool(self.recent))

    def _check_model(self, module):
        """Refuse a model of another depth than the one the cache was made for: its last layer would
        never be the cache's, and no pass would ever join the cache."""
        cfg = getattr(module, "config", None)
        n = getattr(cfg, "num_hidden_layers", None) if cfg is not None else None
        if isinstance(n, int) and n != self.n_layers:
            self._abort()
            raise KVSimdValueError("%s was made for a model of %d layers; %s runs in a model of %d: make a cache "
                                   "for that model" % (type(self).__name__, self.n_layers, type(module).__name__, n))

    def _attend(self, layer, q, out, mask, scale, softcap, window):
        p = self._pending
        if p is None or p["next"] != layer + 1:
            raise KVSimdValueError("attention over %s layer %d outside its forward pass" % (type(self).__name__, layer))
        if q.shape[0] != p["B"] or q.shape[2] != p["T"]:
            raise KVSimdValueError("query %s does not match the %d x %d tokens the cache took" % (q.shape, p["B"], p["T"]))
        self._attend_rows(layer, q, out, mask, scale, softcap, window, p)
        if layer == self.n_layers - 1:      # the pass's last attention ran: its tokens join the cache
            self._end()
            self._pending = None

    def crop(self, tokens_to_remove):
        """Drop the newest ``-tokens_to_remove`` tokens of every sequence (transformers' convention:
        a negative count; assisted decoding's rollback)."""
        n = _need_int(tokens_to_remove, "tokens_to_remove")
        if n > 0:
            raise KVSimdValueError("crop takes a negative number of tokens to remove, got %d" % n)
        self._abort()
        if n and self.kv is not None:
            with self.kv.transaction():
                for b in range(self.kv.batch):
                    self.kv.truncate(b, -n)


def _kv_f32(t):
    t = t.detach()
    return (t if t.dtype == torch.float32 else t.float()).numpy()


class KVSimdCache(_KVSimdCacheBase):
    """transformers' Cache API over a :class:`kvsimd.KVCache`: ``dtype`` float16 (default),
    float32, int8, int4 or "int8/int4" (int8 keys, int4 values) storage,
    ``[layer][K|V][sequence][kv head][slot][head_dim]`` in one C block (int8 and int4: each row
    quantized once as it is written, with a float32 scale per 32 values; int4 two values per byte);
    it starts at ``capacity`` tokens (default: the first pass,
    at least 256) and doubles when full, like ``DynamicCache`` (the copy is amortized).  Needs
    ``attn_implementation="kvsimd"``.  ``hadamard`` as :class:`kvsimd.KVCache` (default: True when
    K or V is int4, False otherwise; quantized caches only): every block of 32 values of K and V stored
    turned by the 32 x 32 Hadamard matrix, which spreads an outlier channel over its block before
    the block's scale is taken; attention turns the query and the output (scores and outputs
    are those of the unturned rows).  ``recent`` = R > 0 (quantized caches only): the cache also
    keeps the float16 K/V rows of each sequence's last R tokens (:class:`kvsimd.KVCache`'s
    ``recent``), and every query row, of the prompt and of each step, reads its last R keys
    (itself included) from float16 rows and older keys quantized, as kvsimd's own Decoder does
    with ``cache_recent=R`` (``ops.attend``'s ``recent_window``): 32 takes most of int4's
    perplexity cost away (README).

    Greedy, sampling, batches with (left) padding, assisted / prompt-lookup decoding (``crop``);
    not beam search."""

    def __init__(self, model, dtype="float16", capacity=None, hadamard=None, recent=0):
        super().__init__(model, dtype, hadamard, recent)
        self.capacity = None if capacity is None else _need_int(capacity, "capacity", 1)

    def _committed(self):
        return self.kv.length(0)

    def _begin(self, B, T):
        kv = self._same_batch(B)
        L = 0 if kv is None else kv.length(0)
        if kv is None or L + T > kv.capacity:
            cap = max(L + T, 256 if self.capacity is None else self.capacity)
            if kv is not None:
                cap = max(cap, 2 * kv.capacity)
            self._make(B, cap, kv)
        self._pending = {"B": B, "T": T, "next": 0, "slots": [L] * B, "extent": L + T}

    def _end(self):
        p = self._pending
        for b in range(p["B"]):
            self.kv.append(b, p["T"])

    def _attend_rows(self, layer, q, out, mask, scale, softcap, window, p):
        N, T = p["extent"], p["T"]
        for b in range(p["B"]):
            if T == 1 and mask is None and (not window or window >= N):
                self._step_row(layer, q, out, b, N, scale, softcap)
                continue
            # each row's last R keys from float rows (recent): this pass's, the committed ones before
            K, V = self._blocks[layer][b]
            _attend_seq(q[b], K, V, _runs(mask, b, N), N, T, window, scale, softcap, out[b], self._scales[layer][b],
                        self.kv.hadamard, recent=self._pass_rows(layer, b, p) if self.recent else None)


class KVSimdSinkCache(_KVSimdCacheBase):
    """StreamingLLM's cache for transformers models: the first ``n_keep`` tokens (attention sinks)
    and the last ``window`` ones, in a kvsimd ring that never fills -- generation runs past any
    length in bounded memory.  Policy ``sink_query`` of :class:`kvsimd.KVCache`: keys stay as
    transformers rotated them (never rewritten, so no rounding accumulates); the window is read at
    true distances and the sinks with the query rotated to its position in the cache
    (``n_keep + window - 1`` once full), as in kvsimd's own Decoder under that policy.

    ``dtype``, ``hadamard`` and ``recent`` as :class:`KVSimdCache` (float16, float32, int8, int4 or
    "int8/int4"; turned by the Hadamard matrix by default when K or V is int4; float rows of the
    last ``recent`` tokens, those of window tokens once the ring wraps, as KVCache keeps them).  The prompt must fit (``n_keep + window`` tokens); after the
    ring wraps, one token per step.  RoPE families (:data:`SINK_FAMILIES`) without sliding-window
    layers; unpadded batches."""

    _policy = "sink_query"

    def __init__(self, model, window, n_keep=4, dtype="float16", hadamard=None, recent=0):
        super().__init__(model, dtype, hadamard, recent)
        c = self._config
        fam = getattr(c, "model_type", None)
        if fam not in SINK_FAMILIES:
            raise KVSimdValueError("KVSimdSinkCache knows the RoPE of %s models, not %r" % (", ".join(SINK_FAMILIES), fam))
        if getattr(c, "sliding_window", None) and (getattr(c, "use_sliding_window", True) is not False):
            raise KVSimdValueError("KVSimdSinkCache: this %s config has sliding-window layers (sliding_window=%r); the "
                                   "sink cache is for full-attention layers" % (fam, c.sliding_window))
        self.window = _need_int(window, "window", 1)
        self.n_keep = _need_int(n_keep, "n_keep", 0)
        from kvsimd.loaders.hf import rope_spec
        self.rope = rope_spec(c, self.head_dim)

    def _streaming(self):
        return {"n_keep": self.n_keep, "policy": "sink_query"}

    def _committed(self):
        return int(self.kv.seen[0])

    def _begin(self, B, T):
        kv = self._same_batch(B)
        if kv is None:
            self._make(B, self.n_keep + self.window)
            kv = self.kv
        L = kv.length(0)
        wrapped = int(kv.seen[0]) != L or int(kv.head[0]) != self.n_keep
        if L and T == 1 and (wrapped or L + 1 > kv.capacity):
            tx = kv.transaction()
            tx.__enter__()
            try:
                plan = kv.begin_step(np.full(B, -1, dtype=np.int64), rope=self.rope)
                rows = [plan.row(b) for b in range(B)]
            except BaseException:
                tx.__exit__(*sys.exc_info())
                raise
            self._pending = {"B": B, "T": 1, "next": 0, "slots": [r[1] for r in rows], "extent": kv.capacity,
                             "plan": plan, "rows": rows, "tx": tx}
            return
        if wrapped or L + T > kv.capacity:
            raise KVSimdCapacityError("KVSimdSinkCache holds %d sinks + a window of %d: %s" % (
                self.n_keep, self.window, "a pass of %d tokens after the window filled (one token per step then)" % T
                if wrapped else "a prompt of %d tokens after %d does not fit; make the window larger" % (T, L)))
        self._pending = {"B": B, "T": T, "next": 0, "slots": [L] * B, "extent": L + T}

    def _end(self):
        p = self._pending
        if "plan" in p:
            self.kv.end_step(p["plan"])
            p["tx"].__exit__(None, None, None)
        else:
            for b in range(p["B"]):
                self.kv.append(b, p["T"])

    def _abort(self):
        p, self._pending = self._pending, None
        if p is not None and "tx" in p:
            p["tx"].__exit__(KVSimdValueError, KVSimdValueError("forward pass abandoned"), None)

    def _attend_rows(self, layer, q, out, mask, scale, softcap, window, p):
        if mask is not None:
            raise KVSimdValueError("KVSimdSinkCache takes unpadded batches (its sinks are each sequence's first "
                                   "tokens); this batch has padding")
        if window:
            raise KVSimdValueError("KVSimdSinkCache is for full-attention layers, this one has a sliding window")
        rows = p.get("rows")
        for b in range(p["B"]):
            K, V = self._blocks[layer][b]
            ks, vs = self._scales[layer][b]
            if rows is None and p["T"] == 1:
                self._step_row(layer, q, out, b, p["extent"], scale, softcap)
                continue
            if rows is None:
                N = p["extent"]
                _attend_seq(q[b], K, V, [(0, N)], N, p["T"], 0, scale, softcap, out[b], (ks, vs), self.kv.hadamard,
                            recent=self._pass_rows(layer, b, p) if self.recent else None)
                continue
            _, slot, kpos, spos, ranges = rows[b]
            q2 = np.ascontiguousarray(q[b, :, 0, :])
            alt = None
            if any(r[0] for r in ranges):
                alt = q2.copy()[None]
                ops.shift_keys(alt, spos - kpos, theta=self.rope.theta, style="neox", rotary_dim=self.rope.rotary_dim,
                               inv_freq=self.rope.inv_freq)
                alt = alt[0]
            extra = {}
            if self.recent:   # its last keys from float rows (the plan's ranges leave them out), scored with q
                nf = p["plan"].float_keys(b)
                extra["recent"] = self.kv._float_rows(layer, b, *p["computed"][b], nf - 1)
                if not ranges:
                    ops.attend(q2, *extra["recent"], scale=scale, softcap=softcap, out=out[b, 0])
                    continue
            ops.attend(q2, K, V, ranges=[(t0, t1, bool(u)) for u, t0, t1, _ in ranges], q_alt=alt, scale=scale,
                       softcap=softcap, out=out[b, 0], k_scale=ks, v_scale=vs, hadamard=self.kv.hadamard, **extra)


__all__ = ["attention", "attention_mask", "register", "enable", "KVSimdCache", "KVSimdSinkCache", "NAME",
           "SINK_FAMILIES"]
