"""`edgellm run`, `info`, the optional prepare subcommands, and errors: one line on stderr, exit status 1, no
traceback."""
import re
import subprocess
import sys
import types

import pytest

from conftest import FIXTURES, SMOLLM2, load_reference
from edgellm import cli


def test_run_prompt_from_file_with_sampling_flags(smollm2_path, tmp_path, capsys):
    ref = load_reference(SMOLLM2)[0]["greedy"][0]
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(ref["prompt"], encoding="utf-8")
    rc = cli.main(["run", str(smollm2_path), "-f", str(prompt_file), "-n", "8", "-c", "256", "--temp", "0",
                   "--top-k", "40", "--repeat-penalty", "1.0", "--seed", "3", "--stop", "\n\n"])
    out, err = capsys.readouterr()
    assert rc == 0
    expected = ref["greedy_text"].split("\n\n")[0]  # greedy, cut at the stop string
    assert out == ref["prompt"] + expected + "\n"
    assert "generation:" in err and "t/s" in err


def test_info_summarises_metadata_tensors_and_memory(real_model, capsys):
    name, path = real_model
    assert cli.main(["info", str(path), "-c", "4096"]) == 0
    out = capsys.readouterr().out
    for expected in ("architecture", "tensors:", "Q8_0", "memory plan at n_ctx = 4096", "weights", "KV full attention"):
        assert expected in out
    if name == "gemma-3-270m":
        assert "KV sliding window 512" in out and "262144" in out
    from edgellm.quant.threading_layer import chosen_layer
    assert f"threading layer: {chosen_layer()}" in out
    from edgellm.prep.info import support_lines
    assert all(line in out for line in support_lines())


def test_info_lists_every_registered_architecture_and_format():
    from edgellm.engine.models import ALIASES, ARCHITECTURES
    from edgellm.prep.info import support_lines
    from edgellm.quant.formats import FORMATS
    archs, formats = support_lines()
    listed = [w for w in re.findall(r"[a-z0-9_-]+", archs.split(": ", 1)[1]) if w != "also"]  # (gpt-oss)
    assert sorted(listed) == sorted(set(ARCHITECTURES) | set(ALIASES))
    assert formats.split(": ", 1)[1].split(", ") == [f.name for f in FORMATS]


def test_memory_plan_matches_the_allocated_cache(gemma_path):
    import edgellm
    from edgellm.engine import gguf
    from edgellm.prep.info import memory_plan

    m = edgellm.load(gemma_path, n_ctx=1024)
    with gguf.open(gemma_path) as f:
        plan = memory_plan(f, 1024)
    cache = m.model.cache
    assert plan.kv_bytes == cache._block.nbytes
    # every layer's slots, kind by kind (at n_ctx 1024 the window layers' rounded ring is as long as the context)
    assert sorted(k.slots for k in plan.layer_kinds for _ in range(k.n_layers)) == sorted(cache.capacities)
    assert plan.weights_bytes == sum(t.nbytes for t in m.file.tensors.values())


def test_prepare_subcommands_are_added_when_the_module_exists(monkeypatch):
    def add_subcommands(sub):
        p = sub.add_parser("quantize")
        p.set_defaults(func=lambda args: 7)

    monkeypatch.setitem(sys.modules, "edgellm.prep.cli", types.SimpleNamespace(add_subcommands=add_subcommands))
    assert cli.main(["quantize"]) == 7


@pytest.mark.parametrize("argv, message", [
    (["run", "no-such-model"], "unknown model 'no-such-model'"),
    (["run", str(FIXTURES / "gemma-3-270m-q4_k_m.json")], "not a GGUF file"),
    (["info", "/nonexistent/model.gguf"], "does not exist"),
    (["run", "{smollm2}", "--top-p", "1.5"], "top_p must be in [0, 1]"),
    (["run", "{smollm2}", "--repeat-last-n", "-5"], "repeat_last_n"),
    (["run", "{smollm2}", "-p", ""], "the prompt is empty"),
    (["run", "{smollm2}", "-f", "/nonexistent/prompt.txt"], "No such file"),
    (["chat", "{smollm2}", "--temp", "nan"], "temperature must be a finite number"),
])
def test_errors_are_one_line_without_traceback(argv, message, smollm2_path):
    argv = [a.replace("{smollm2}", str(smollm2_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", *argv], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1
    assert proc.stderr.startswith("edgellm: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""

