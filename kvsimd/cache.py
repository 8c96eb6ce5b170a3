"""The caches (compiled: they own their C memory and their state).

- :class:`KVCache`: the self-attention K/V of every layer and sequence, with the ring buffer and
  streaming policies of infinite generation; a forward pass is ``begin_prefill`` / ``begin_step``
  -> the layers -> ``end_prefill`` / ``end_step`` inside ``transaction()``.
- :class:`CrossAttentionCache`: the projected encoder output of an encoder-decoder.
- :class:`RopeSpec`: validated RoPE parameters (with a scaled RoPE's frequencies and attention
  factor), the one check used by every RoPE path.
"""
from kvsimd._kvsimd import POLICIES, CrossAttentionCache, KVCache, RopeSpec

__all__ = ["KVCache", "CrossAttentionCache", "RopeSpec", "POLICIES"]
