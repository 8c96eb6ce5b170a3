"""The part every C microbenchmark of the avx512 row shares: compile bench/<name>.c with that row's
flags (src_c/isa_rows.def) and run it, where this CPU runs the row.

Used by fp16_widen_cost.py, lane_tile_loads.py and int8_dot_speed.py."""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src_c"))
from isa_rows import read_rows  # noqa: E402


def build(name, exe, werror=True):
    """Compile bench/<name>.c into exe with the avx512 row's flags (and kvsimd's kernel headers on
    the include path)."""
    flags = dict(read_rows())["avx512"]
    strict = ["-Wall", "-Wextra", "-Werror"] if werror else []
    subprocess.run(["gcc", "-O2", "-std=c11"] + strict + flags +
                   ["-I" + os.path.join(ROOT, "src_c"), "-I" + os.path.join(ROOT, "src_c", "kernels"),
                    os.path.join(HERE, name + ".c"), "-o", exe, "-lm"], check=True)


def run(name, arg_lists, werror=True):
    """Exit with a message unless this CPU runs the avx512 row; else build bench/<name>.c and run it
    once per list of arguments."""
    import kvsimd
    if "avx512" not in kvsimd.isa_info()["supported"]:
        sys.exit("this CPU does not run the avx512 row (AVX-512 F/BW/VL/DQ/VNNI)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, name)
        build(name, exe, werror)
        for args in arg_lists:
            subprocess.run([exe] + list(args), check=True)


def length_main(name, doc, seconds):
    """The command line of a benchmark whose one argument scales its rounds' length."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--length", type=float, default=1.0,
                    help="rounds' length, in (0, 100] (1: about %d s)" % seconds)
    args = ap.parse_args()
    if not 0 < args.length <= 100:
        ap.error("--length must be in (0, 100]")
    run(name, [[repr(args.length)]])
