"""One ISA row's attention kernel from two source trees, timed call by call in one process.

    python bench/kernel_ab.py OLD NEW --isa avx512 --shape 32,1,128 --tokens 65536
                              [--dtype float16] [--reps 30] [--offset 0]

OLD and NEW are git revisions of this repository, or ``.`` for the work tree as it is.  Each
tree's ``src_c/kernels/tu_<isa>.c`` is compiled with the row's flags (src_c/isa_rows.def) and its
symbols are prefixed (objcopy), so both rows link into one program (bench/kernel_ab.c) with the C
core of NEW (its scalar row only).  Each repeat times OLD's kernel, then NEW's, on the same
buffers: one decode step of every KV head on one thread, K and V 2 MiB aligned and advised as
huge pages, as a KVCache's are (``--offset`` adds bytes to both: numpy's arrays start 16 bytes
into a page).  Printed: both medians, the median and quartiles of NEW / OLD over the repeats
(below 1: NEW is faster), and the largest difference of the two outputs.  Timing the two calls
side by side cancels most of a shared machine's drift, which moves unpaired runs of one kernel
by 25% here from minute to minute.  Needs gcc, objcopy and a CPU that runs the row; compiling
takes about a minute.

A kernel change whose workspace layout grows needs NEW's ops.c (kv_attn_workspace_bytes) to
cover OLD's layout too, as it does when OLD is an earlier revision."""
import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src_c"))
from isa_rows import read_rows  # noqa: E402

CORE = ["cpu.c", "dispatch.c", "ops.c", "membench.c", "cache.c", "layout.c"]
BASE = ["-O2", "-fno-tree-loop-distribute-patterns", "-fno-stack-protector"]


def tree(rev, tmp, name):
    """The src_c directory of revision rev ('.': this work tree)."""
    if rev == ".":
        return os.path.join(ROOT, "src_c")
    out = os.path.join(tmp, name)
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "src_c"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return os.path.join(out, "src_c")


def row_command(src, isa, flags, obj):
    """gcc compiling tree src's row isa with its flags into obj."""
    return ["gcc"] + BASE + flags + ["-I" + src, "-I" + os.path.join(src, "kernels"),
                                      "-DKV_ROW_CFLAGS=\"%s\"" % " ".join(flags), "-c",
                                      os.path.join(src, "kernels", "tu_%s.c" % isa), "-o", obj]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--isa", default="avx512")
    ap.add_argument("--shape", action="append", help="H,HKV,D (repeatable; default 32,1,128)")
    ap.add_argument("--tokens", type=int, action="append", help="N (repeatable; default 65536)")
    ap.add_argument("--dtype", action="append", choices=["float16", "float32", "int8", "int4"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--offset", type=int, default=0)
    args = ap.parse_args()
    rows = dict(read_rows())
    if args.isa not in rows:
        ap.error("unknown row %r (rows: %s)" % (args.isa, ", ".join(rows)))
    shapes = []
    for shape in args.shape or ["32,1,128"]:
        try:
            H, Hkv, D = (int(x) for x in shape.split(","))
        except ValueError:
            ap.error("--shape %r: expected H,HKV,D (three integers)" % shape)
        if not (1 <= Hkv <= H <= 4096 and H % Hkv == 0 and 1 <= D <= 512):
            ap.error("--shape %r: needs 1 <= HKV <= H <= 4096 with HKV dividing H, and 1 <= D <= 512" % shape)
        shapes.append((H, Hkv, D))
    if any(not 1 <= n <= 2 ** 24 for n in args.tokens or []) or not 1 <= args.reps <= 10000 or \
            not 0 <= args.offset < 2 ** 20:
        ap.error("--tokens must be in 1..2**24, --reps in 1..10000 and --offset in 0..2**20-1")
    import kvsimd
    if args.isa not in kvsimd.isa_info()["supported"]:
        sys.exit("this CPU does not run the %s row" % args.isa)
    with tempfile.TemporaryDirectory() as tmp:
        old, new = tree(args.old, tmp, "old"), tree(args.new, tmp, "new")
        inc = ["-I" + new, "-I" + os.path.join(new, "kernels")]
        objs = [os.path.join(tmp, f + ".o") for f in CORE]
        jobs = [["gcc"] + BASE + ["-fopenmp", "-DKV_BUILT_ROWS=KV_ROW(scalar)"] + inc +
                ["-c", os.path.join(new, f), "-o", o] for f, o in zip(CORE, objs)]
        rowobjs = [os.path.join(tmp, p + args.isa + ".o") for p in ("A_", "B_")]
        if args.isa != "scalar":   # the core's own row (the scalar one of NEW's tree serves it otherwise)
            objs.append(os.path.join(tmp, "scalar.o"))
            jobs.append(row_command(new, "scalar", [], objs[-1]))
        jobs += [row_command(old, args.isa, rows[args.isa], rowobjs[0] + ".raw"),
                 row_command(new, args.isa, rows[args.isa], rowobjs[1] + ".raw")]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            if any(pool.map(lambda cmd: subprocess.run(cmd).returncode, jobs)):
                sys.exit("compiling failed")
        for raw, obj, prefix in ((rowobjs[0] + ".raw", rowobjs[0], "A_"), (rowobjs[1] + ".raw", rowobjs[1], "B_")):
            subprocess.run(["objcopy", "--prefix-symbols=" + prefix, raw, obj], check=True)
        if args.isa == "scalar":
            objs.append(rowobjs[1] + ".raw")
        objs += rowobjs
        exe = os.path.join(tmp, "kernel_ab")
        subprocess.run(["gcc"] + BASE + inc + ["-fopenmp", "-DROW_A=A_kv_kernels_" + args.isa,
                        "-DROW_B=B_kv_kernels_" + args.isa, os.path.join(HERE, "kernel_ab.c")] + objs +
                       ["-o", exe, "-lm"], check=True)
        print("OLD = A = %s, NEW = B = %s, row %s, 1 thread" % (args.old, args.new, args.isa), flush=True)
        for H, Hkv, D in shapes:
            for n in args.tokens or [65536]:
                for dt in args.dtype or ["float16"]:
                    if subprocess.run([exe, str(H), str(Hkv), str(D), str(n), str(args.reps), dt,
                                       str(args.offset)]).returncode:   # it said why (out of memory)
                        sys.exit(1)


if __name__ == "__main__":
    main()
