"""The C unit tests (tests/c/, built by CMakeLists.txt) run under ctest, from pytest so that
the one test command covers them.  Needs cmake and a C compiler (installed by .ci/run)."""
import json
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, "%s failed:\n%s\n%s" % (" ".join(cmd), r.stdout[-4000:], r.stderr[-4000:])
    return r


def extension_row_archives():
    """setup.py's archives of the kernel rows (build/clib) when the imported extension was linked
    from them: built in this tree (pip install -e, setup.py build_ext --inplace), one archive per
    compiled row, none newer than the extension.  Else None."""
    import kvsimd
    so = kvsimd._kvsimd.__file__
    clib = os.path.join(ROOT, "build", "clib")
    if not os.path.realpath(so).startswith(os.path.realpath(ROOT) + os.sep) or not os.path.isdir(clib):
        return None
    rows = kvsimd.isa_info()["compiled"]
    have = sorted(f[len("libkv_"):-2] for f in os.listdir(clib) if f.startswith("libkv_") and f.endswith(".a"))
    if have != sorted(rows) or any(os.path.getmtime(os.path.join(clib, "libkv_%s.a" % isa)) > os.path.getmtime(so)
                                   for isa in rows):
        return None
    return clib


def test_ctest(tmp_path):
    """The C unit tests, and the AVX-512 rows' objects free of outside symbols (the emulator runs
    them with nothing else mapped).  Over the extension's own row archives when it has them (the
    objects the Python tests and the emulator run; no second compile of the rows, 150-200 s in
    CI), else over rows that CMake compiles."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed for the C unit tests (pip install cmake)"
    build = str(tmp_path / "cbuild")
    clib = extension_row_archives()
    run([cmake, "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release"]
        + (["-DKVSIMD_ROW_ARCHIVES=" + clib] if clib else []))
    run([cmake, "--build", build, "-j2"])
    r = run(["ctest", "--test-dir", build, "--output-on-failure"])
    assert "100% tests passed" in r.stdout
    assert "avx512fp16_object_is_freestanding" in r.stdout  # gcc >= 12 builds that row here
    assert "avx512_object_is_freestanding" in r.stdout


def test_sanitize_option_reaches_the_library_and_kernels(tmp_path):
    """-DKVSIMD_SANITIZE=ON must instrument the kernel objects and the C core, not only the test
    executable (compile options set after a target is defined never reach it)."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed for the C unit tests (pip install cmake)"
    build = tmp_path / "sanbuild"
    run([cmake, "-S", ROOT, "-B", str(build), "-DKVSIMD_SANITIZE=ON", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"])
    cmds = json.loads((build / "compile_commands.json").read_text())
    by_file = {os.path.relpath(c["file"], ROOT): c["command"] for c in cmds}
    for src in ("src_c/kernels/tu_scalar.c", "src_c/kernels/tu_avx2.c", "src_c/cache.c", "src_c/ops.c",
                "tests/c/test_kernels.c"):
        assert "-fsanitize=address,undefined" in by_file[src], (src, by_file[src])
