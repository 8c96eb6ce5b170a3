"""Every ```python example in README.md runs as written; the decoding example's output is checked
against the model's own tokens decoded in one go (no stop token, no U+FFFD halves)."""
import os
import re

import pytest

from test_gguf import model_dir  # noqa: F401  (fixture: SmolLM2 in the pytest cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_examples():
    """(section heading, code) of every ```python block of the README."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    out, heading = [], "(top)"
    for part in re.split(r"^(## .*|```python\n[\s\S]*?^```)$", text, flags=re.M):
        if part.startswith("## "):
            heading = part[3:].strip()
        elif part.startswith("```python"):
            out.append((heading, part[len("```python\n"):-3]))
    return out


EXAMPLES = python_examples()


def test_the_examples_are_found():
    assert [h for h, _ in EXAMPLES].count("Models and decoding") == 1 and len(EXAMPLES) >= 2


@pytest.mark.parametrize("heading,code", EXAMPLES, ids=[h for h, _ in EXAMPLES])
def test_readme_example_runs(request, capsys, heading, code):
    if "models.smollm2" in code:
        request.getfixturevalue("model_dir")      # the model from the pytest cache, downloaded once
    ns = {"__name__": "readme"}
    exec(compile(code, "README.md (%s)" % heading, "exec"), ns)
    out = capsys.readouterr().out
    if heading == "Models and decoding":
        m, tok, ids = ns["m"], ns["tok"], ns["ids"]
        want = list(m.generate(ids, max_new_tokens=64, stop_tokens=[tok.eos_id]))
        assert tok.eos_id not in want                 # a stop token ends the stream, it is not yielded
        assert out == tok.decode(want) + "\n"
        assert "<|im_end|>" not in out and "\ufffd" not in out
