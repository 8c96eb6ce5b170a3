"""hypothesis strategies for kvsimd's kernels: shapes with awkward tails, GQA ratios,
positions near the limits."""
from hypothesis import strategies as st

# head dims: vector-width tails (1, 3, 17, 80) as well as the fast sizes
head_dims = st.sampled_from([1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 48, 64, 80, 96, 100, 128, 256, 512])
gqa_ratios = st.sampled_from([1, 3, 4, 8])
kv_heads = st.integers(1, 3)
# token counts: block tails around 8/16 and a few long caches
token_counts = st.one_of(st.integers(1, 40), st.sampled_from([63, 64, 65, 127, 257, 1000, 5000]))
kv_dtypes = st.sampled_from(["float32", "float16"])
styles = st.sampled_from(["gptj", "neox"])
seeds = st.integers(0, 2**32 - 1)


@st.composite
def rope_shapes(draw):
    """(H, N, D, rotary_dim) with rotary_dim even and <= D, sometimes < D."""
    D = draw(st.sampled_from([2, 4, 6, 8, 14, 16, 18, 32, 34, 64, 80, 96, 128, 256, 512]))
    rd = draw(st.one_of(st.just(D), st.integers(1, D // 2).map(lambda r: 2 * r)))
    H = draw(st.integers(1, 4))
    N = draw(st.one_of(st.integers(1, 20), st.sampled_from([64, 100, 333])))
    return H, N, D, rd


positions_near_limit = st.integers(2**31 - 10_000, 2**31 + 10_000)
