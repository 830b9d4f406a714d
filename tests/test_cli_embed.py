"""`edgellm embed`: the vectors it prints are the API's own (Model.embed / create_embedding) for every input, each
pooling and format, read from -p, a file or standard input; bad input exits 1 with one line and prints nothing."""
import io
import json

import pytest

import edgellm
from edgellm import cli
from edgellm.generation.embeddings import POOLINGS

TEXTS = ["The capital of France is Paris.", "Berlin", "A lighthouse keeper finds a message in a bottle."]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=256)


def _run(capsys, *argv):
    rc = cli.main(["embed", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_array_of_prompts_is_the_apis_vectors(model, smollm2_path, capsys):
    rc, out, _ = _run(capsys, smollm2_path, "-c", "256", *[a for t in TEXTS for a in ("-p", t)])
    assert rc == 0
    assert json.loads(out) == model.embed(TEXTS)  # json round-trips each float exactly


def test_file_lines_jsonl_last_pooling_unnormalised(model, smollm2_path, tmp_path, capsys):
    f = tmp_path / "inputs.txt"
    f.write_text("\n".join([TEXTS[0], "", "   ", TEXTS[1]]) + "\n", encoding="utf-8")  # blank lines skipped
    rc, out, _ = _run(capsys, smollm2_path, "-c", "256", "-p", TEXTS[2], "-f", f, "--format", "jsonl",
                      "--pooling", "last", "--no-normalize")
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    order = [TEXTS[2], TEXTS[0], TEXTS[1]]  # the -p texts, then the file's lines
    assert [r["index"] for r in rows] == [0, 1, 2] and [r["input"] for r in rows] == order
    assert [r["embedding"] for r in rows] == model.embed(order, pooling="last", normalize=False)


def test_stdin_with_per_token_vectors_in_openai_shape(model, smollm2_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[1] + "\n" + TEXTS[0] + "\n"))
    rc, out, _ = _run(capsys, smollm2_path, "-c", "256", "-f", "-", "--format", "openai", "--pooling", "none")
    assert rc == 0
    got = json.loads(out)
    want = model.create_embedding([TEXTS[1], TEXTS[0]], pooling="none")
    assert got["object"] == "list" and got["usage"] == want["usage"]
    assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in want["data"]]
    assert len(got["data"][1]["embedding"]) == len(model.tokenize(TEXTS[0]))  # a vector per token


def test_pooling_choices_are_the_engines():
    action = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["embed"]._actions
                  if a.dest == "pooling")
    assert tuple(action.choices) == POOLINGS


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to embed"),
    (["-f", "{blank}"], "nothing to embed"),
    (["-p", "x" * 3000, "-c", "64"], "more than the context"),
])
def test_bad_input_is_one_line_and_prints_nothing(argv, message, smollm2_path, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    rc, out, err = _run(capsys, smollm2_path, *[a.format(blank=blank) for a in argv])
    assert rc == 1 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
