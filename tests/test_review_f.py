"""Review findings F: the chat template is untrusted code (sandboxed, every size bounded), the CLI's
seed range and error reporting, a closed stdout, text that is not UTF-8, a non-UTF-8 KVSIMD_FORCE_ISA."""
import os
import subprocess
import sys
import time

import pytest

import kvsimd
from kvsimd import Decoder
from kvsimd.loaders.tokenizer import CHAT_TEMPLATE_MAX_CHARS

from test_cli import cli, one_error_line, tiny  # noqa: F401  (fixtures)
from test_gguf import gguf, model_dir, tok, write_llama_gguf  # noqa: F401  (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MSG = [{"role": "user", "content": "x"}]


def tokenizer_with_template(tmp_path, template):
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, meta={"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})
    return Decoder.from_gguf(path).tokenizer


def test_chat_template_cannot_reach_python_internals(tmp_path):
    marker = tmp_path / "PWNED"
    for attack in ("{{ cycler.__init__.__globals__.os.system('touch %s') }}" % marker,
                   "{{ messages.__class__.__mro__[1].__subclasses__() }}",
                   "{{ raise_exception.__globals__ }}"):
        tk = tokenizer_with_template(tmp_path, attack)
        with pytest.raises(kvsimd.KVSimdValueError, match=r"tokenizer\.chat_template"):
            tk.apply_chat_template(MSG)
        assert not marker.exists()


def test_chat_template_cannot_change_the_messages(tmp_path):
    tk = tokenizer_with_template(tmp_path, "{{ messages.append(1) }}{{ messages[0].update(role='x') }}")
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(kvsimd.KVSimdValueError, match=r"tokenizer\.chat_template"):
        tk.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "x"}]


HUGE = ["{% for i in range(10**9) %}{{ i }}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'x' * 10**8 }}", "{{ 10**8 * ['x'] }}", "{{ 10 ** 100000000 }}",
        "{{ 'x'.ljust(10**8) }}", "{{ 'x'|center(10**8) }}", "{{ '%*s' % (10**8, 'x') }}",
        "{{ '%*s'|format(10**8, 'x') }}",
        "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% for i in range(50000) %}{{ messages[0].content * 1000 }}{% endfor %}",
        "{{ lipsum(10**6) }}",
        "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = '{}{}'.format(ns.s, ns.s) %}{% endfor %}",
        "{% set ns = namespace(s=['x']) %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s]|sum(start=[]) %}"
        "{% endfor %}",
        "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "{% for a in range(99999) %}{% set t = 'x' * 1000000 %}{% endfor %}",
        "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}{% endfor %}{% endfor %}"
        "{% endfor %}",
        "{{ ('x\\n' * 500000)|indent(1000000) }}", "{{ ('x\\n' * 500000).replace('\\n', 'y' * 1000000) }}",
        "{{ ('x\\n' * 500000)|replace('\\n', 'y' * 1000000) }}", "{{ (['y' * 1000000] * 1000)|join }}",
        "{{ 'ab'.join(['y' * 1000000] * 1000) }}", "{{ ([['y'] * 1000000] * 1000)|sum(start=[]) }}",
        "{{ ('\\t' * 1000000).expandtabs(1000000) }}", "{{ ('x ' * 500000)|wordwrap(1, wrapstring='y' * 1000000) }}"]


@pytest.mark.parametrize("template", HUGE)
def test_chat_template_sizes_are_bounded(tmp_path, template):
    tk = tokenizer_with_template(tmp_path, template)
    t = time.perf_counter()
    with pytest.raises(kvsimd.KVSimdValueError, match=r"tokenizer\.chat_template"):
        tk.apply_chat_template(MSG)
    assert time.perf_counter() - t < 10      # a render is bounded in time too (CHAT_TEMPLATE_WORK)


def test_chat_template_within_the_limit_renders(tmp_path):
    tk = tokenizer_with_template(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content * 2 }}"
                                           "{{ '-' * 10 }}{% endfor %}{{ range(3)|list|join(',') }}")
    assert tk.apply_chat_template([{"role": "user", "content": "ab"}]) == "<user>abab----------0,1,2"
    big = "y" * (CHAT_TEMPLATE_MAX_CHARS + 10)     # long messages are the caller's: not refused
    assert tk.apply_chat_template([{"role": "user", "content": big}]) == "<user>" + big * 2 + "-" * 10 + "0,1,2"
    tk = tokenizer_with_template(tmp_path, "{{ 'a-b'|replace('-', '+') }}|{{ ', '.join(['a', 'b']) }}|"
                                           "{{ 'x\\ny'|indent(2) }}|{{ [[1], [2]]|sum(start=[]) }}|"
                                           "{{ 'a b c'|wordwrap(2) }}|{{ 'a\\tb'.expandtabs(4) }}")
    assert tk.apply_chat_template(MSG) == "a+b|a, b|x\n  y|[1, 2]|a\nb\nc|a   b"


def test_cli_chat_with_a_hostile_template_is_one_line(tmp_path):
    marker = tmp_path / "PWNED"
    path = str(tmp_path / "evil.gguf")
    write_llama_gguf(path, meta={"tokenizer.chat_template": (
        "{{ cycler.__init__.__globals__.os.system('touch %s') }}" % marker, gguf.GGUFValueType.STRING)})
    r = cli(["generate", "--model", path, "--chat", "hi"])
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("kvsimd: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert "tokenizer.chat_template" in r.stderr
    assert not marker.exists()


def test_smollm2_chat_template_renders_as_transformers_does(tok):
    T = pytest.importorskip("transformers")
    from test_gguf import CHAT
    from kvsimd.loaders import registry as models
    htok = T.AutoTokenizer.from_pretrained(os.path.dirname(models.smollm2_path()), gguf_file=models.SMOLLM2_FILE)
    for msgs in (CHAT, CHAT + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "More"}],
                 [{"role": "system", "content": "Be brief."}] + CHAT):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == \
                htok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


# ------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("seed", [str(2**63), str(2**64 - 1)])
def test_cli_seed_beyond_generates_range_is_a_usage_error(tiny, seed):
    r = cli(["generate", "--model", tiny, "--seed", seed, "--temperature", "1", "hi"])
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert "argument --seed:" in line and repr(seed) in line and str(2**63 - 1) in line, line


def test_cli_largest_seed_generates_reproducibly(tiny):
    args = ["generate", "--model", tiny, "--seed", str(2**63 - 1), "--temperature", "1", "--max-new-tokens", "6",
            "hi"]
    r1, r2 = cli(args), cli(args)
    assert r1.returncode == 0, r1.stderr
    assert r1.stdout == r2.stdout and len(r1.stdout) > 1


@pytest.mark.parametrize("when", ["call", "first step"])
def test_cli_error_from_generate_reaches_the_user(tiny, monkeypatch, capsys, when):
    from kvsimd import __main__ as cli_main
    from kvsimd.nn import Decoder

    def failing_generate(self, *a, **kw):
        if when == "call":
            raise kvsimd.KVSimdValueError("the real error, at the call")

        def gen():
            raise kvsimd.KVSimdValueError("the real error, at the first step")
            yield
        return gen()
    monkeypatch.setattr(Decoder, "generate", failing_generate)
    rc = cli_main.main(["generate", "--model", tiny, "--max-new-tokens", "3", "hi"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.splitlines()[-1] == "kvsimd: error: the real error, at the " + when, err


def test_cli_closed_stdout_is_one_clear_line(tiny):
    r = subprocess.run([sys.executable, "-m", "kvsimd", "generate", "--model", tiny, "--max-new-tokens", "3", "hi"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 1, r.stderr
    assert r.stderr == "kvsimd: error: standard output is closed: nowhere to write the generated text\n", r.stderr


# ------------------------------------------------------------------------------ text that is not UTF-8
@pytest.fixture(scope="module")
def tiny_tok(tiny):
    return Decoder.from_gguf(tiny).tokenizer


@pytest.mark.parametrize("text,index", [("\udcff", 0), ("ab\ud800c", 2), ("x" * 100 + "\udfff", 100)])
def test_encode_refuses_lone_surrogates_naming_the_text(tiny_tok, text, index):
    with pytest.raises(kvsimd.KVSimdValueError, match=r"text must be valid Unicode .*lone surrogate U\+%04X at index %d"
                       % (ord(text[index]), index)) as e:
        tiny_tok.encode(text)
    assert repr(text[:20])[:-1] in str(e.value)
    assert tiny_tok.encode("ab\U0001F600c") == tiny_tok.encode("ab") + tiny_tok.encode("\U0001F600") + \
        tiny_tok.encode("c")      # a valid astral character (a surrogate pair in UTF-16) is fine


def test_cli_prompt_argument_not_utf8_is_one_line(tiny):
    r = subprocess.run([sys.executable.encode(), b"-m", b"kvsimd", b"generate", b"--model", tiny.encode(),
                        b"ab\xffcd"], capture_output=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode() == ("kvsimd: error: the prompt argument is not valid UTF-8 (byte 0xff at offset 2)\n")


@pytest.mark.parametrize("lang", ["C.UTF-8", "C"])
def test_cli_prompt_on_stdin_not_utf8_is_one_line(tiny, lang):
    r = subprocess.run([sys.executable, "-m", "kvsimd", "generate", "--model", tiny], input=b"hello \xc3(",
                       capture_output=True, cwd=ROOT, timeout=120, env=dict(os.environ, LC_ALL=lang, LANG=lang))
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode() == "kvsimd: error: the prompt on stdin is not valid UTF-8 (byte 0xc3 at offset 6)\n"


def test_cli_utf8_prompt_still_works(tiny):
    r = subprocess.run([sys.executable, "-m", "kvsimd", "generate", "--model", tiny, "--max-new-tokens", "2"],
                       input="héllo ✿".encode(), capture_output=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert b"prefill %d tokens" % len(Decoder.from_gguf(tiny).tokenizer.encode("héllo ✿")) in r.stderr


# ------------------------------------------------------------------------------ KVSIMD_FORCE_ISA bytes
def run_env(code_args, value):
    env = dict(os.environb)
    env[b"KVSIMD_FORCE_ISA"] = value
    return subprocess.run([sys.executable, *code_args], capture_output=True, cwd=ROOT, timeout=120, env=env)


@pytest.mark.parametrize("value", [b"\xff", b"avx2\xe9", b"x" + "é".encode() * 300])
def test_force_isa_not_utf8_or_long_is_an_import_error(value):
    r = run_env(["-c", "import kvsimd"], value)
    assert r.returncode == 1
    last = r.stderr.decode("utf-8", "replace").splitlines()[-1]
    assert last.startswith("ImportError: kvsimd: KVSIMD_FORCE_ISA=" + value[:7].decode("utf-8", "backslashreplace")), \
        r.stderr
    if len(value) < 100:
        assert "unknown ISA" in last and "compiled: scalar" in last, last


def test_force_isa_not_utf8_under_the_cli_is_one_line():
    r = run_env(["-m", "kvsimd", "generate", "hi"], b"\xff")
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode().startswith("kvsimd: error: KVSIMD_FORCE_ISA=\\xff: unknown ISA '\\xff' (compiled: ")
    assert len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("name,match", [("\udcff", "unknown ISA"), ("sc\ud800", "unknown ISA"),
                                        ("scalar\x00avx2", "must not contain NUL")])
def test_use_isa_odd_names_are_isa_errors(name, match):
    from kvsimd.testing import use_isa
    before = kvsimd.active_isa()
    with pytest.raises(kvsimd.KVSimdISAError, match=match):
        with use_isa(name):
            pass
    assert kvsimd.active_isa() == before
