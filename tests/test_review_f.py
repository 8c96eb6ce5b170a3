"""Review findings F: the chat template is untrusted code (sandboxed, every size bounded), the CLI's
seed range and error reporting, a closed stdout, text that is not UTF-8, a non-UTF-8 KVSIMD_FORCE_ISA."""
import os
import subprocess
import sys
import time

import pytest

import kvsimd
from kvsimd import Decoder
from kvsimd.tokenizer import CHAT_TEMPLATE_MAX_CHARS

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
        "{{ lipsum(10**6) }}"]


@pytest.mark.parametrize("template", HUGE)
def test_chat_template_sizes_are_bounded(tmp_path, template):
    tk = tokenizer_with_template(tmp_path, template)
    t = time.perf_counter()
    with pytest.raises(kvsimd.KVSimdValueError, match=r"tokenizer\.chat_template"):
        tk.apply_chat_template(MSG)
    assert time.perf_counter() - t < 10


def test_chat_template_within_the_limit_renders(tmp_path):
    tk = tokenizer_with_template(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content * 2 }}"
                                           "{{ '-' * 10 }}{% endfor %}{{ range(3)|list|join(',') }}")
    assert tk.apply_chat_template([{"role": "user", "content": "ab"}]) == "<user>abab----------0,1,2"
    big = "y" * (CHAT_TEMPLATE_MAX_CHARS + 10)     # long messages are the caller's: not refused
    assert tk.apply_chat_template([{"role": "user", "content": big}]) == "<user>" + big * 2 + "-" * 10 + "0,1,2"


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
    from kvsimd import models
    htok = T.AutoTokenizer.from_pretrained(os.path.dirname(models.smollm2_path()), gguf_file=models.SMOLLM2_FILE)
    for msgs in (CHAT, CHAT + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "More"}],
                 [{"role": "system", "content": "Be brief."}] + CHAT):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == \
                htok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def cli(args, env=None, timeout=300, **kw):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvsimd", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=ROOT, **kw)
