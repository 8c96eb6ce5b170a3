"""Benchmark case lists, shared by ``python -m kvsimd.bench`` and the pytest-benchmark suites in bench/."""

# (name, H, Hkv, D): decode-time attention shapes
ATTN_SHAPES = [
    ("smollm2-gqa", 9, 3, 64),      # SmolLM2-135M: 9 query heads over 3 KV heads
    ("llama-gqa", 32, 8, 128),      # Llama-3-8B-like: GQA ratio 4
    ("mha-128", 32, 32, 128),       # multi-head attention
]
CONTEXTS = [512, 2048, 8192, 32768]
QUICK_CONTEXTS = [512, 2048]
DTYPES = ["float16", "float32"]
