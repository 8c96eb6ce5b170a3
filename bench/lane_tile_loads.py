"""What the query-on-lanes path's register tiles wait for on the avx512 row: 512-bit loads per cycle.

    python bench/lane_tile_loads.py [--length L]

Compiles bench/lane_tile_loads.c with the avx512 row's flags (src_c/isa_rows.def) and runs it: per
TSC cycle, the rate of 512-bit loads (VMOVAPS zmm, VBROADCASTSS zmm) beside 256-bit broadcasts, of
FMAs alone, and of attn.inc.h's two lanes tiles (2 x 8 with one head-dim element per lane, 4 x 6
in the pair layout) over L1-resident data; quartiles over rounds.  Needs gcc and a CPU with
AVX-512 F/BW/VL/DQ/VNNI."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import avx512_c  # noqa: E402


def build(exe):
    """Compile lane_tile_loads.c into exe with the avx512 row's flags."""
    avx512_c.build("lane_tile_loads", exe)


if __name__ == "__main__":
    avx512_c.length_main("lane_tile_loads", __doc__, 5)
