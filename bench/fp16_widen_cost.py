"""What widening fp16 K/V rows costs the FMA rate of a group of query heads, on the avx512 row.

    python bench/fp16_widen_cost.py [--length L]

Compiles bench/fp16_widen_cost.c with the avx512 row's flags (src_c/isa_rows.def) and runs it:
GFLOP/s of attn.inc.h's output tile (2, 4 and 8 query heads, data in L1) with V as fp32 rows, as
fp16 rows widened by VCVTPH2PS, and widened by integer ops, and the fp16 / fp32 ratio: on a core
whose widening shares the FMA pipes (Zen 4), that ratio bounds the fraction of the FMA peak that
fp16 attention of that group size can reach.  Needs gcc and a CPU with AVX-512 F/BW/VL/DQ/VNNI."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import avx512_c  # noqa: E402


def build(exe):
    """Compile fp16_widen_cost.c into exe with the avx512 row's flags."""
    avx512_c.build("fp16_widen_cost", exe)


if __name__ == "__main__":
    avx512_c.length_main("fp16_widen_cost", __doc__, 10)
