"""kvsimd inside other libraries' models (the weight importers, which turn other libraries' models
into kvsimd's own, are :mod:`kvsimd.loaders`).

- :mod:`kvsimd.integrations.transformers`: an attention backend (``attn_implementation="kvsimd"``)
  and KV caches (plain and attention-sink) for Hugging Face ``transformers`` models and their
  ``generate``.
"""
