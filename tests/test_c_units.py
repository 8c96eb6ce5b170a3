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


def test_ctest(tmp_path):
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed for the C unit tests (pip install cmake)"
    build = str(tmp_path / "cbuild")
    run([cmake, "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release"])
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
