"""`edgellm batch IN OUT`: a JSONL file of prompts and chats through the batch engine. Each greedy record equals
the line generated alone, per-line options included; bad lines become error records with their line number and
the run goes on; a run killed mid-way (SIGKILL) and run again loses no completed line and ends with the same OUT as
an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hardening_tiny import tiny_spec, write_loadable_tiny_model

import edgellm
from edgellm import cli
from edgellm.generation import jobs

CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_loadable_tiny_model(tmp_path_factory.mktemp("jobs") / "tiny.gguf", tiny_spec(seed=3)))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return edgellm.load(tiny_path, n_ctx=128, n_threads=1)


def request_lines():
    """Prompts and chats with per-line max_tokens, stop strings, a constraint and ids."""
    lines = []
    for i in range(14):
        line = {"prompt": "hello world " * (i % 3 + 1) + "go" * (i % 4)} if i % 3 else \
               {"messages": [{"role": "user", "content": f"hello {i}"}]}
        if i % 2:
            line["max_tokens"] = 6 + i
        if i % 5 == 4:
            line["stop"] = ["l"]
        if i % 4 == 1:
            line["id"] = f"req-{i}"
        lines.append(line)
    lines.append({"prompt": "or go", "choice": CHOICES, "id": {"n": 99}})
    return lines


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def alone(m, line, max_tokens):
    m.reset()  # from an empty cache: a reused prefix would run in a batch of another size
    options = {k: v for k, v in line.items() if k in jobs.LINE_OPTIONS}
    options.setdefault("max_tokens", max_tokens)
    ids = m.chat_prompt_ids(line["messages"]) if "messages" in line else m.prompt_ids(line["prompt"])
    return m.complete(ids, **options)


def test_greedy_records_equal_each_line_generated_alone(tiny, tmp_path):
    lines = request_lines()
    write_jsonl(tmp_path / "in.jsonl", lines)
    summary = jobs.run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                            jobs.local_executor(tiny, {"max_tokens": 10}, n_parallel=3), progress=False)
    records = read_records(tmp_path / "out.jsonl")
    assert summary.lines == len(lines) and summary.errors == 0 and summary.skipped == 0
    assert sorted(r["index"] for r in records) == list(range(len(lines)))
    for record in records:
        line = lines[record["index"]]
        want = alone(tiny, line, 10)
        assert record.get("id") == line.get("id")
        assert (record["text"], record["finish_reason"]) == (want.text, want.finish_reason), record
        assert record["usage"] == {"prompt_tokens": want.prompt_tokens, "completion_tokens": want.completion_tokens,
                                   "total_tokens": want.prompt_tokens + want.completion_tokens}
    assert summary.completion_tokens == sum(r["usage"]["completion_tokens"] for r in records)
    by_index = {r["index"]: r for r in records}
    assert by_index[len(lines) - 1]["text"] in CHOICES
    assert len({r["usage"]["completion_tokens"] for r in records}) > 2  # per-line max_tokens and stops took effect


def test_bad_lines_are_reported_with_their_line_number_and_the_run_goes_on(tiny, tmp_path, capsys):
    good = {"prompt": "hello"}
    lines = [good, "{not json", {"text": "no prompt"}, {"prompt": "x", "messages": []}, good,
             {"prompt": "x", "temperature": "hot"}, {"prompt": ""}, {"prompt": "x", "colour": 1}, [1, 2], good,
             {"prompt": "x", "logit_bias": {"100000": 1}}]
    write_jsonl(tmp_path / "in.jsonl", lines)
    cli.main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", tiny.path, "-n", "4",
              "-c", "128", "-t", "1", "--no-progress"])
    err = capsys.readouterr().err
    records = {r["index"]: r for r in read_records(tmp_path / "out.jsonl")}
    assert sorted(records) == list(range(len(lines)))
    bad = [i for i in range(len(lines)) if lines[i] is not good]
    for i in bad:
        assert records[i]["error"]["line"] == i + 1 and records[i]["error"]["message"]
        assert f"line {i + 1}: " in err
    assert "not valid JSON" in records[1]["error"]["message"]
    assert "colour" in records[7]["error"]["message"]
    assert "temperature" in records[5]["error"]["message"]
    for i in (0, 4, 9):
        assert "error" not in records[i] and records[i]["usage"]["completion_tokens"] == 4
    assert "8 errors" in err


def _batch_command(tiny_path, in_path, out_path):
    return [sys.executable, "-m", "edgellm.cli", "batch", str(in_path), str(out_path), "--model", tiny_path,
            "-n", "48", "--ignore-eos", "-c", "128", "-t", "1", "--parallel", "2", "--no-progress"]


def test_a_run_killed_mid_way_resumes_without_losing_a_completed_line(tiny, tiny_path, tmp_path):
    n = 400
    lines = [{"prompt": f"hello {'world ' * (i % 5)}go"} | ({"id": i * 7} if i % 2 else {}) for i in range(n)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(edgellm.__file__)))}
    whole = tmp_path / "whole.jsonl"
    subprocess.run(_batch_command(tiny_path, tmp_path / "in.jsonl", whole), check=True, env=env, timeout=600)

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_batch_command(tiny_path, tmp_path / "in.jsonl", out), env=env)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 20):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    text = out.read_text()
    before = [json.loads(line) for line in text.split("\n")[:-1]]  # whole lines only: the last may be cut
    assert 20 <= len(before) < n, "the kill did not land mid-run"

    subprocess.run(_batch_command(tiny_path, tmp_path / "in.jsonl", out), check=True, env=env, timeout=600)
    after = read_records(out)
    assert after[:len(before)] == before  # nothing completed was lost or rewritten
    assert sorted(after, key=lambda r: r["index"]) == sorted(read_records(whole), key=lambda r: r["index"])
    assert len({r["index"] for r in after}) == n  # and nothing ran twice


def test_resume_matches_lines_by_id_and_by_index(tiny, tmp_path):
    """Lines with an id are matched by it (so lines inserted before them do not re-run them); others by index."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello", "id": "a"}, {"prompt": "go"}])
    ex = jobs.local_executor(tiny, {"max_tokens": 3})
    jobs.run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", ex, progress=False)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "new"}, {"prompt": "hello", "id": "a"}, {"prompt": "go"}])
    summary = jobs.run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", ex, progress=False)
    records = read_records(tmp_path / "out.jsonl")
    # "a" is done (by its id) wherever it moved; lines without an id go by position: "new" took index 0 and runs,
    # and "go", now at index 2, runs again
    assert (summary.lines, summary.skipped) == (2, 1)
    assert sorted(r["index"] for r in records[2:]) == [0, 2]
    assert sum(r.get("id") == "a" for r in records) == 1


def test_progress_bar_counts_lines_and_tokens_per_second(tmp_path, capsys):
    """The bar (tqdm, on stderr) over the lines still to do, with the tokens/s of the records so far."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    write_jsonl(tmp_path / "out.jsonl", [{"index": 0, "text": "", "finish_reason": "stop", "usage": {}}])

    def execute(lines):  # records as a model would give them, 3 tokens each
        for index, _ in lines:
            time.sleep(0.01)
            yield {"index": index, "text": "abc", "finish_reason": "length",
                   "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    summary = jobs.run_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", execute, progress=True)
    err = capsys.readouterr().err
    assert (summary.lines, summary.skipped, summary.completion_tokens) == (4, 1, 12)
    assert "4/4" in err and "tok/s" in err and "line" in err
    assert 0 < summary.tokens_per_s and summary.first_record_s <= summary.seconds
