"""Benchmark case lists, shared by ``python -m kvsimd.bench`` and the pytest-benchmark suites in bench/."""

# (name, H, Hkv, D): decode-time attention shapes
ATTN_SHAPES = [
    ("smollm2-gqa", 9, 3, 64),      # SmolLM2-135M: 9 query heads over 3 KV heads
    ("llama-gqa", 32, 8, 128),      # Llama-3-8B-like: GQA ratio 4
    ("mha-128", 32, 32, 128),       # multi-head attention
]
# decode attention against its ceiling, min(read bandwidth, FMA peak / G): the group sizes models use
CEILING_SHAPES = [
    ("mha-128", 32, 32, 128),       # G = 1
    ("llama-gqa", 32, 8, 128),      # G = 4 (Llama-3-8B, Mistral)
    ("g8-128", 64, 8, 128),         # G = 8 (Llama-3-70B)
    ("smollm2-gqa", 9, 3, 64),      # G = 3
    ("mqa-128", 32, 1, 128),        # G = 32: multi-query attention
]
# the int8 KV cache beside float16 (python -m kvsimd.bench attention)
INT8_SHAPES = [
    ("smollm2-gqa", 9, 3, 64),
    ("llama-gqa", 32, 8, 128),
    ("mha-128", 32, 32, 128),
    ("g8-128", 64, 8, 128),
    ("mqa-128", 32, 1, 128),        # the query-on-lanes path
]
INT8_CONTEXTS = [8192, 32768]
CONTEXTS = [512, 2048, 8192, 32768]
QUICK_CONTEXTS = [512, 2048]
DTYPES = ["float16", "float32"]
