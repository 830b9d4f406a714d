"""Batch jobs over JSONL files: `edgellm batch IN OUT` in-process, and the Ray Data integration, which runs the same
requests on actors (edgellm/integrations/ray.py).

Sections: a request line (a prompt or a chat, with its own options and an optional id); the output records; the
batch engine over many requests with continuous refill (`run_requests`); resume (what OUT already holds); the file
job (`run_file`): durable appends and the progress bar.

Each input line is a JSON object: {"prompt": "..."} or {"messages": [...]}, optional "id" (any JSON value), and any
of LINE_OPTIONS, which override the job's defaults for that line. Each output line is a record:
{"index": line number from 0, "id": ..., "text", "finish_reason", "usage": {...}} or, for a line that could not
run, {"index", "id", "error": {"line": line number from 1, "message"}}. Records are written as lines finish, so OUT
is in completion order; sort by "index" for input order.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

from edgellm.errors import EdgeLLMError
from edgellm.generation.batch import pool_for, run_batch
from edgellm.generation.decoding import logit_bias_arrays
from edgellm.generation.options import SAMPLING_NAMES, GenerationOptions, parse_options

# per-line options: the generation options a JSON line can carry (callables and logprobs cannot)
LINE_OPTIONS = tuple(SAMPLING_NAMES) + ("max_tokens", "stop", "seed", "ignore_eos", "logit_bias", "grammar",
                                        "response_format", "json_schema", "regex", "choice")
LINE_FIELDS = ("id", "prompt", "messages") + LINE_OPTIONS
DEFAULT_PARALLEL = 16   # sequences decoded together: past this a small model's decode step stops getting cheaper
CHUNK_PER_SLOT = 32     # requests handed to the batch engine at a time, per slot: bounds memory on huge files


# ---------------------------------------------------------------------------------------------------------------
# A request line
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Request:
    index: int                      # line number in IN, from 0
    id: object = None               # the line's "id", if it has one
    ids: list | None = None         # prompt token ids
    opts: GenerationOptions | None = None
    bias: object = None             # opts.logit_bias as arrays (edgellm.generation.decoding.logit_bias_arrays)
    error: str | None = None        # why the line cannot run


def line_id(text: str):
    """The "id" of a JSON line, None when it has none or is not a JSON object."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data.get("id") if isinstance(data, dict) else None


def parse_request(model, index: int, text: str, defaults: dict) -> Request:
    """One JSON line as a Request, ready to run; on any fault, a Request whose error says what is wrong."""
    req = Request(index)
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a line must be a JSON object, got {type(data).__name__}")
        req.id = data.get("id")
        unknown = sorted(set(data) - set(LINE_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (accepted: prompt or messages, id, {', '.join(LINE_OPTIONS)})")
        if ("prompt" in data) == ("messages" in data):
            raise ValueError("a line needs exactly one of \"prompt\" and \"messages\"")
        options = {**defaults, **{k: v for k, v in data.items() if k in LINE_OPTIONS}}
        req.opts = parse_options("line", options, model.NATIVE_DEFAULTS)
        if "messages" in data:
            if not isinstance(data["messages"], list):
                raise ValueError("\"messages\" must be a list of messages")
            req.ids = model.chat_prompt_ids(data["messages"])
        else:
            if not isinstance(data["prompt"], (str, list)):
                raise ValueError("\"prompt\" must be text or a list of token ids")
            req.ids = model.prompt_ids(data["prompt"])
        req.bias = logit_bias_arrays(req.opts, model.n_vocab)
    except json.JSONDecodeError as e:
        req.error = f"not valid JSON: {e}"
    except (EdgeLLMError, ValueError, TypeError, KeyError) as e:
        req.error = str(e) or type(e).__name__
    return req


# ---------------------------------------------------------------------------------------------------------------
# Output records
# ---------------------------------------------------------------------------------------------------------------

def completion_record(req: Request, completion) -> dict:
    record = {"index": req.index}
    if req.id is not None:
        record["id"] = req.id
    record.update(text=completion.text, finish_reason=completion.finish_reason,
                  usage={"prompt_tokens": completion.prompt_tokens,
                         "completion_tokens": completion.completion_tokens,
                         "total_tokens": completion.prompt_tokens + completion.completion_tokens})
    return record


def error_record(req: Request) -> dict:
    record = {"index": req.index}
    if req.id is not None:
        record["id"] = req.id
    record["error"] = {"line": req.index + 1, "message": req.error}
    return record


# ---------------------------------------------------------------------------------------------------------------
# The batch engine over many requests
# ---------------------------------------------------------------------------------------------------------------

def run_requests(model, lines, defaults: dict, n_parallel: int = DEFAULT_PARALLEL):
    """Yield a record for each (index, JSON text) of `lines` as it finishes (error records at once). Up to
    n_parallel sequences decode together and a finished one's slot takes the next request (continuous refill),
    each with its own options."""
    n_parallel = max(1, min(n_parallel, model.model.n_batch))
    seq_ctx = 0  # the pool only grows across chunks, so it is allocated again only when a longer request comes
    chunk = []
    for index, text in lines:
        req = parse_request(model, index, text, defaults)
        if req.error is not None:
            yield error_record(req)
            continue
        chunk.append(req)
        if len(chunk) >= n_parallel * CHUNK_PER_SLOT:
            seq_ctx = yield from _run_chunk(model, chunk, n_parallel, seq_ctx)
            chunk = []
    if chunk:
        yield from _run_chunk(model, chunk, n_parallel, seq_ctx)


def _run_chunk(model, chunk: list, n_parallel: int, seq_ctx: int):
    fm = model.model
    for req in chunk:  # room for the prompt and its tokens, at most the model's context
        want = model.n_ctx if req.opts.max_tokens is None else len(req.ids) + req.opts.max_tokens + 1
        seq_ctx = max(seq_ctx, min(model.n_ctx, want), 2 * fm.n_keep + 2)
    pool = pool_for(model, min(n_parallel, len(chunk)), seq_ctx)
    done = deque()
    steps = run_batch(model, [r.ids for r in chunk], [r.opts for r in chunk], pool, [r.bias for r in chunk],
                      on_finish=lambda i, completion: done.append(completion_record(chunk[i], completion)))
    try:
        for _ in steps:
            while done:
                yield done.popleft()
    finally:
        steps.close()
    while done:
        yield done.popleft()
    return seq_ctx


# ---------------------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------------------

def completed(out_path) -> tuple[set, set]:
    """The ids, and the indices of records without one, that OUT already has records for. A last line cut short by a kill is removed from
    the file, so appends start on a fresh line."""
    indices, ids = set(), set()
    if not os.path.exists(out_path):
        return indices, ids
    with open(out_path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    for raw in data[:end].splitlines():
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and record.get("id") is not None:
            ids.add(_id_key(record["id"]))
        elif isinstance(record, dict) and "index" in record:
            indices.add(record["index"])
    return indices, ids


def _id_key(value) -> str:
    return json.dumps(value, sort_keys=True)  # ids may be any JSON value; compared by their JSON text


def pending_lines(in_path, indices: set, ids: set):
    """(index, text) of the lines of IN that OUT has no record for: a line with an id is matched by its id, any
    other by its index. Blank lines are skipped."""
    with open(in_path, encoding="utf-8", errors="replace") as f:
        for index, text in enumerate(f):
            text = text.strip()
            if not text:
                continue
            key = line_id(text)
            if (key is not None and _id_key(key) in ids) or (key is None and index in indices):
                continue
            yield index, text


# ---------------------------------------------------------------------------------------------------------------
# The file job
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class JobSummary:
    lines: int = 0          # records written by this run
    skipped: int = 0        # lines OUT already had
    errors: int = 0         # of lines, the error records
    completion_tokens: int = 0
    seconds: float = 0.0
    first_record_s: float = 0.0  # start-up included: model load, or a Ray cluster and its actors

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def run_file(in_path, out_path, execute, progress: bool = True, err=None) -> JobSummary:
    """Run the lines of IN that OUT lacks through execute(list of (index, text)) -> iterator of records, appending
    each record to OUT and flushing it as it comes (a kill loses only the lines in flight); fsync at the end.
    Bad lines are reported on `err` (stderr) with their line number."""
    err = err or sys.stderr
    indices, ids = completed(out_path)
    todo = list(pending_lines(in_path, indices, ids))
    summary = JobSummary(skipped=_count_lines(in_path) - len(todo))
    bar = _progress_bar(len(todo), progress)
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as out:
        try:
            for record in execute(todo):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                summary.lines += 1
                summary.first_record_s = summary.first_record_s or time.perf_counter() - t0
                if "error" in record:
                    summary.errors += 1
                    _report(err, bar, f"edgellm: line {record['error']['line']}: {record['error']['message']}")
                else:
                    summary.completion_tokens += record["usage"]["completion_tokens"]
                summary.seconds = time.perf_counter() - t0
                if bar is not None:
                    bar.set_postfix_str(f"{summary.tokens_per_s:.1f} tok/s", refresh=False)
                    bar.update(1)
        finally:
            out.flush()
            os.fsync(out.fileno())
            if bar is not None:
                bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _count_lines(in_path) -> int:
    with open(in_path, encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line.strip())


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # start-up time: only a job with a progress bar loads it
    return tqdm(total=total, unit="line", dynamic_ncols=True, file=sys.stderr)


def _report(err, bar, message: str) -> None:
    if bar is not None and err is sys.stderr:
        bar.write(message, file=err)  # above the bar, which redraws below it
    else:
        print(message, file=err, flush=True)


def local_executor(model, defaults: dict, n_parallel: int = DEFAULT_PARALLEL):
    """execute() for run_file: the requests through this process's model."""
    return lambda lines: run_requests(model, lines, defaults, n_parallel)
