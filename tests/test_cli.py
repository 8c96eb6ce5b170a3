"""`python -m kvsimd generate` run as a user runs it (a subprocess), on a tiny random GGUF model:
every bad flag or environment variable is one `kvsimd: error:` line naming it, --threads is capped
at the cores this process may use, Ctrl-C exits 130 with the statistics, a full fixed cache says so."""
import os
import pty
import re
import signal
import subprocess
import sys
import time

import pytest

import kvsimd

from test_gguf import model_dir, ours_int8, write_llama_gguf  # noqa: F401  (fixtures: SmolLM2 from the pytest cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 1-layer model whose 40-token vocabulary has no end-of-sequence token (it never stops)."""
    path = str(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    write_llama_gguf(path, meta={"tokenizer.ggml.eos_token_id": None})
    return path


def cli(args, env=None, timeout=300, **kw):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvsimd", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=ROOT, **kw)


def one_error_line(r):
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsimd: error: "), r.stderr
    return lines[0]


BAD_FLAGS = [("--n-keep", "-1"), ("--window", "1"), ("--window", "x"), ("--temperature", "nan"),
             ("--temperature", "-0.5"), ("--temperature", "inf"), ("--seed", "-1"), ("--seed", "1.5"),
             ("--top-p", "0"), ("--top-p", "nan"), ("--top-p", "1.01"), ("--top-k", "-3"), ("--max-new-tokens", "0"),
             ("--threads", "0"), ("--threads", "two"), ("--cache-dtype", "int2"), ("--policy", "slide"),
             ("--lookup", "-1"), ("--lookup", "x"), ("--lookup", "257")]


@pytest.mark.parametrize("flag,value", BAD_FLAGS)
def test_bad_flag_is_one_line_naming_it(tiny, flag, value):
    r = cli(["generate", "--model", tiny, flag, value, "hi"])
    assert r.returncode == 2
    line = one_error_line(r)
    assert "argument %s:" % flag in line and repr(value) in line, line
    assert r.stdout == ""


@pytest.mark.parametrize("var,value", [("KVSIMD_FORCE_ISA", "bogus"), ("KVSIMD_NUM_THREADS", "abc"),
                                       ("KVSIMD_NUM_THREADS", "0"), ("KVSIMD_NUM_THREADS", "-4")])
def test_bad_environment_is_one_line_naming_it(tiny, var, value):
    r = cli(["generate", "--model", tiny, "hi"], env={var: value})
    assert r.returncode == 2
    line = one_error_line(r)
    assert var in line and value in line, line


def test_threads_capped_at_the_cores_this_process_may_use(tiny):
    one_cpu = sorted(os.sched_getaffinity(0))[:1]
    r = cli(["generate", "--model", tiny, "--threads", "100000", "--max-new-tokens", "8", "hi"],
            preexec_fn=lambda: os.sched_setaffinity(0, one_cpu), timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == ("kvsimd: warning: --threads 100000 is more than the 1 core this process may use; "
                        "using 1"), r.stderr
    assert len(lines) == 2 and "decode 8 tokens" in lines[1]


def test_ctrl_c_exits_130_with_the_statistics(tiny):
    # SIGINT as a terminal gives it: a process started in the background by a shell without job
    # control inherits SIGINT ignored, and Python then leaves it ignored (a CI job launched with
    # `cmd &` hung here for that reason)
    p = subprocess.Popen([sys.executable, "-m", "kvsimd", "generate", "--model", tiny, "--policy", "sink_query",
                          "--window", "32", "--max-new-tokens", "100000000", "hi"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = os.read(p.stdout.fileno(), 1)      # the first token is out: generation is running
        assert first
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    out, err = (first + out).decode(), err.decode()
    assert p.returncode == 130, err
    assert out.endswith("\n") and len(out) > 1
    lines = err.splitlines()
    assert lines[-1] == "kvsimd: interrupted" and "Traceback" not in err, err
    assert lines[-2].startswith("load ") and " decode " in lines[-2] and "isa " in lines[-2], err


def test_fixed_policy_reaching_the_window_says_so(tiny):
    r = cli(["generate", "--model", tiny, "--policy", "fixed", "--window", "6", "--max-new-tokens", "20", "hi"])
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("load ") and re.search(r"decode [45] tokens", lines[0]), r.stderr
    assert lines[1].startswith("kvsimd: error: ") and "--window" in lines[1] and "full" in lines[1], r.stderr
    assert r.stdout.endswith("\n") and len(r.stdout) >= 1 + 4    # the tokens that fitted were printed


@pytest.mark.parametrize("args", [["--policy", "fixed", "--window", "4", "--max-new-tokens", "2"],
                                  ["--max-new-tokens", "1"], ["--window", "3", "--max-new-tokens", "1"]])
def test_n_keep_default_fits_a_small_fixed_cache(tiny, args):
    r = cli(["generate", "--model", tiny, *args, "hi"])
    assert r.returncode == 0, r.stderr
    assert "decode %s tokens" % args[-1] in r.stderr


def test_n_keep_leaving_no_window_names_the_flags(tiny):
    r = cli(["generate", "--model", tiny, "--policy", "shift", "--window", "6", "--n-keep", "5", "hi"])
    assert r.returncode == 2
    line = one_error_line(r)
    assert "--n-keep 5" in line and "--window" in line


def test_no_prompt_and_a_terminal_says_how_to_give_one(tiny):
    master, slave = pty.openpty()
    try:
        r = cli(["generate", "--model", tiny], stdin=slave, timeout=30)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2
    line = one_error_line(r)
    assert "no prompt" in line and "pipe it on stdin" in line


def test_prompt_from_a_pipe(tiny):
    r = cli(["generate", "--model", tiny, "--max-new-tokens", "3"], input="abc")
    assert r.returncode == 0, r.stderr
    assert "prefill 3 tokens" in r.stderr and "decode 3 tokens" in r.stderr


def test_bad_model_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (10**15).to_bytes(8, "little") * 2)
    r = cli(["generate", "--model", str(bad), "hi"])
    assert r.returncode == 1
    assert "claims" in one_error_line(r)


def test_unknown_model_name_is_one_line():
    r = cli(["generate", "--model", "smollm", "hi"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert "unknown model 'smollm'" in line and "smollm2" in line


def test_usage_errors():
    for args in (["generate", "--bogus"], [], ["generate", "--top-p", "0", "hi"]):
        r = cli(args)
        assert r.returncode == 2
        assert one_error_line(r)


def test_missing_model_file_is_one_line(tmp_path):
    r = cli(["generate", "--model", str(tmp_path / "missing.gguf"), "hi"])
    assert r.returncode == 1
    assert "GGUF file not found" in one_error_line(r)


def test_sliding_window_generates_past_the_window(tiny):
    r = cli(["generate", "--model", tiny, "--policy", "sink_query", "--window", "12", "--max-new-tokens", "60", "hi"])
    assert r.returncode == 0, r.stderr
    assert "decode 60 tokens" in r.stderr
    r = cli(["generate", "--model", tiny, "--policy", "shift", "--window", "3", "abcdef"])
    assert r.returncode == 2 and "see --window" in one_error_line(r)


def test_lookup_prints_the_greedy_tokens_and_refuses_sampling(tiny):
    base = ["generate", "--model", tiny, "--max-new-tokens", "40", "--cache-dtype", "float32", "abcabcabcabc"]
    plain = cli(base)
    assert plain.returncode == 0, plain.stderr
    r = cli(base + ["--lookup", "4"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout and "decode 40 tokens" in r.stderr
    r = cli(base + ["--lookup", "4", "--temperature", "0.5"])
    assert r.returncode == 2
    line = one_error_line(r)
    assert "--lookup 4" in line and "--temperature 0.5" in line, line


def test_cli_quantized_cache_reports_its_size(tiny):
    """--cache-dtype int8 / int4 / int8/int4: the same run on a quantized KV cache; the KV-cache size
    it reports counts one byte (int8) or half a byte (int4, 16 bytes per block of 32) per value and a
    float32 scale per 32 values (against float32's four bytes per value); int8/int4 an int8 key row
    and an int4 value row."""
    sizes = {}
    for dt in ("float32", "int8", "int4", "int8/int4"):
        r = cli(["generate", "--model", tiny, "--max-new-tokens", "8", "--cache-dtype", dt, "abcabc"])
        assert r.returncode == 0, r.stderr
        assert "decode 8 tokens" in r.stderr and dt in r.stderr
        sizes[dt] = float(re.search(r"KV cache ([0-9.e+-]+) MiB", r.stderr).group(1))
    cfg = kvsimd.Decoder.from_gguf(tiny).cfg
    nb = -(-cfg.head_dim // 32)
    per = (cfg.head_dim + 4 * nb) / (4 * cfg.head_dim)
    assert sizes["int8"] > 0 and sizes["int8"] == pytest.approx(sizes["float32"] * per, rel=1e-3)
    per = (16 * nb + 4 * nb) / (4 * cfg.head_dim)
    assert sizes["int4"] > 0 and sizes["int4"] == pytest.approx(sizes["float32"] * per, rel=1e-3)
    per = (cfg.head_dim + 4 * nb + 16 * nb + 4 * nb) / (2 * 4 * cfg.head_dim)
    assert sizes["int8/int4"] > 0 and sizes["int8/int4"] == pytest.approx(sizes["float32"] * per, rel=1e-3)



def test_cli_cache_recent_rows(tiny):
    """--cache-recent R: an int4 cache that also keeps its last R tokens' float16 K/V rows (a ring of
    4R per layer and KV head, counted in the size it reports); with a float cache one error line."""
    sizes = {}
    for extra in ([], ["--cache-recent", "4"]):
        r = cli(["generate", "--model", tiny, "--max-new-tokens", "8", "--cache-dtype", "int4", *extra, "abcabc"])
        assert r.returncode == 0, r.stderr
        assert "decode 8 tokens" in r.stderr
        sizes[bool(extra)] = float(re.search(r"KV cache ([0-9.e+-]+) MiB", r.stderr).group(1))
    cfg = kvsimd.Decoder.from_gguf(tiny).cfg
    ring = cfg.n_layers * cfg.n_kv_heads * 4 * 4 * 2 * 2 * cfg.head_dim / 2**20
    assert sizes[True] == pytest.approx(sizes[False] + ring, rel=1e-3)
    r = cli(["generate", "--model", tiny, "--max-new-tokens", "8", "--cache-recent", "4", "abcabc"])
    assert r.returncode != 0 and "recent keeps float16 rows of a quantized cache" in one_error_line(r)


# ------------------------------------------------------------------------------ the real model (SmolLM2)
def test_cli_generates_the_same_tokens(ours_int8):
    ours = ours_int8          # the CLI loads with from_gguf's defaults (int8 activations)
    prompt = "The old king said to his daughters:"
    r = cli(["generate", "--model", ours.source, "--max-new-tokens", "12", "--cache-dtype", "float32", prompt])
    assert r.returncode == 0, r.stderr
    want = ours.tokenizer.decode(list(ours.generate(ours.tokenizer.encode(prompt), max_new_tokens=12,
                                                    cache_dtype="float32")))
    assert r.stdout == want + "\n"
    for key in ("load", "prefill", "decode", "tok/s", "KV cache", "isa " + kvsimd.active_isa()):
        assert key in r.stderr


def test_cli_reads_stdin_and_chat(model_dir):
    r = cli(["generate", "--chat", "--max-new-tokens", "32", "--threads", "2"], input="What is 2 + 2?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "<|im_end|>" not in r.stdout       # generate() does not yield the stop token: the answer ends


def test_cli_activations_flag_picks_the_matrices_arithmetic(tmp_path):
    """--activations int8 (the default) / float32: the CLI prints the tokens of the library's model
    loaded with the same choice (Decoder.from_gguf(activations=...)), sampled with the same seed, and
    says which it used.  The model is Q8_0, where the two arithmetics differ slightly: sampled over 48
    tokens their texts part (asserted first), so a flag that were ignored fails a comparison."""
    path = str(tmp_path / "q8.gguf")
    write_llama_gguf(path, qtype="Q8_0", meta={"tokenizer.ggml.eos_token_id": None})
    lib = {a: kvsimd.Decoder.from_gguf(path, activations=a) for a in ("int8", "float32")}
    tok = lib["int8"].tokenizer
    want = {a: tok.decode(list(m.generate(tok.encode("hi"), max_new_tokens=48, temperature=1.0, seed=5,
                                          cache_dtype="float32", stop_tokens=[]))) for a, m in lib.items()}
    assert want["int8"] != want["float32"]
    for a in ("int8", "float32", None):
        r = cli(["generate", "--model", path, "--max-new-tokens", "48", "--temperature", "1", "--seed", "5",
                 "--cache-dtype", "float32", "hi"] + ([] if a is None else ["--activations", a]))
        assert r.returncode == 0, r.stderr
        assert r.stdout == want[a or "int8"] + "\n", a
        assert "activations %s" % (a or "int8") in r.stderr
    r = cli(["generate", "--model", path, "--activations", "int4", "hi"])
    assert r.returncode == 2 and "--activations" in one_error_line(r) and "int4" in one_error_line(r)
