"""Record llama.cpp's logits over the broad prompt set as compact fixtures for tests/test_exact_llama_cpp.py.

Run with the python that has llama-cpp-python (tests never need it):

    /path/to/llama-venv/bin/python tools/record_llama_exact.py MODEL.gguf tests/fixtures/exact_<stem>.npz \\
        --prompts tests/fixtures/exact_prompts.json.gz --ppl-text tests/fixtures/ppl_text.txt --ppl-text OTHER.txt

For every prompt (its text tokenized by llama.cpp with special tokens parsed, BOS where the file asks; a chat
rendered with the file's own template first, or, where the file has none, with llama.cpp's built-in template for
its architecture: Gemma's turn markup, as llama.cpp's "gemma" template writes it), it records:
- the greedy continuation (argmax, up to --gen tokens, stopping at an end-of-generation token);
- teacher-forced rows: the prompt and continuation evaluated as one sequence (llama-cpp-python's `eval`, batches
  of n_batch, every row's logits), a sha256 of each row's full float32 logits;
- decode-path rows: the prompt evaluated alone, then the continuation fed one token at a time, a sha256 of the
  prompt's last row and of each step's row (llama.cpp computes a single token with other kernels);
- the top 8 logits of each prompt's last teacher-forced row, for readable failure messages.
And, for each --ppl-text, the perplexity llama-perplexity computes (chunks of --ppl-ctx tokens evaluated one
chunk at a time, BOS swapped into each chunk's first position, the second half of each chunk scored), with the
running estimate after each chunk, each chunk's NLL sum, and for the chunks --ppl-rows names the sha256 of every
row of their logits (a chunk checked alone in CI). --ppl-only records the perplexity part alone into an existing
OUT, keeping its prompts. Perplexity is computed first, and OUT is rewritten every --checkpoint prompts,
so a run cut short still leaves a usable fixture of the prompts it got through (--ids picks and orders them).

The teacher-forced evaluation reuses the decode path's whole 512-token batches of the prompt (identical batches
at identical cells), which halves the time of long prompts; --no-reuse evaluates everything from scratch.
"""
import argparse
import ctypes
import gzip
import hashlib
import json
import math
import os
import time

import numpy as np

TOP_K = 8


def row_hash(row) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(row, dtype=np.float32).tobytes()).digest()


# llama.cpp's built-in templates (llama_chat_apply_template by name) for files that carry no chat template of their
# own, by general.architecture: what llama.cpp's chat endpoint falls back to for them
BUILTIN_TEMPLATES = {"gemma3": "gemma", "gemma2": "gemma", "gemma": "gemma"}


def builtin_template(llm):
    return BUILTIN_TEMPLATES.get(llm.metadata.get("general.architecture", ""))


def render_builtin(llama_cpp, name, messages):
    """The prompt text llama.cpp's own C++ template `name` renders (generation prompt appended)."""
    keep = [(m["role"].encode("utf-8"), m["content"].encode("utf-8")) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    size = 4096 + 2 * sum(len(c) for _, c in keep)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), True, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp has no built-in chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n + 1


def render_chat(llama_cpp, llm, messages):
    meta = llm.metadata
    if "tokenizer.chat_template" not in meta:
        return render_builtin(llama_cpp, builtin_template(llm), messages)
    vocab_tok = lambda i: llm.detokenize([i], special=True).decode("utf-8", errors="replace")  # noqa: E731
    formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter(
        template=meta["tokenizer.chat_template"], eos_token=vocab_tok(llm.token_eos()),
        bos_token=vocab_tok(llm.token_bos()), add_generation_prompt=True)
    return formatter(messages=messages).prompt


def tokenize(llm, text):
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    bos = llm.token_bos()
    if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:  # a template that writes BOS itself
        ids = ids[1:]
    return ids


def eog_ids(llama_cpp, llm):
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def rows_of(llm, start, count):
    return np.asarray(llm.scores[start:start + count], dtype=np.float32)


def record_prompt(llm, ids, n_gen, eog, n_batch, reuse=True):
    # decode path: the prompt as one evaluation, then one token at a time (which is also the greedy run)
    llm.reset()
    llm.eval(ids)
    row = rows_of(llm, len(ids) - 1, 1)[0]
    decode_hashes = [row_hash(row)]
    generated = []
    while True:
        token = int(np.argmax(row))
        generated.append(token)
        if token in eog or len(generated) == n_gen:
            break
        llm.eval([token])
        row = rows_of(llm, llm.n_tokens - 1, 1)[0]
        decode_hashes.append(row_hash(row))
    # teacher-forced: prompt and continuation in one evaluation, every row. Its whole batches before the prompt's
    # last partial one are the decode path's own batches (same tokens, same positions, same cells), so their rows
    # are kept and evaluation resumes there: eval drops the cache from n_tokens on, as reset() does from 0
    seq = list(ids) + generated
    keep = (len(ids) // n_batch) * n_batch if reuse else 0
    llm.n_tokens = keep
    llm.eval(seq[keep:])
    rows = rows_of(llm, 0, len(seq))
    forced_hashes = [row_hash(r) for r in rows]
    last = rows[len(ids) - 1]
    top = np.argsort(-last, kind="stable")[:TOP_K]
    return seq, len(ids), forced_hashes, decode_hashes, top.astype(np.int32), last[top]


def perplexity(llm, text, n_ctx, row_chunks=()):
    """llama-perplexity's loop, one chunk at a time, in double precision as it scores. Returns the final value,
    the running estimate after each chunk (what it prints as [1]..,[2]..), each chunk's NLL sum, the row hashes of
    the chunks in row_chunks ({chunk: [sha256 of each row]}), the chunk count and the token count."""
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = tokens[:1] == [llm.token_bos()]
    n_chunks = len(tokens) // n_ctx
    nll, count, running, chunk_nll, rows = 0.0, 0, [], [], {}
    first = n_ctx // 2
    for c in range(n_chunks):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        logits = rows_of(llm, 0, n_ctx)
        if c in row_chunks:
            rows[c] = [row_hash(r) for r in logits]
        logits = logits.astype(np.float64)
        before = nll
        for pos in range(first, n_ctx - 1):
            row = logits[pos]
            top = row.max()
            lse = top + math.log(np.exp(row - top).sum())
            v = lse - row[chunk[pos + 1]]
            nll += v
            count += 1
        running.append(math.exp(nll / count))
        chunk_nll.append(nll - before)
    return math.exp(nll / count), running, chunk_nll, rows, n_chunks, len(tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-text", action="append", default=[])
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-rows", action="append", default=[], metavar="TEXT:CHUNK",
                    help="keep the row hashes of this chunk (0-based) of the --ppl-text named TEXT (its file name)")
    ap.add_argument("--ppl-only", action="store_true",
                    help="record perplexity only, into an existing OUT whose prompts are kept")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (for a quick look)")
    ap.add_argument("--ids", default="", help="comma-separated prompt ids to record, in this order (default: all)")
    ap.add_argument("--checkpoint", type=int, default=10, help="write OUT after every N prompts (0: only at the end)")
    ap.add_argument("--add", action="store_true",
                    help="keep OUT's recorded prompts (and its perplexity unless --ppl-text is given) and add the others")
    ap.add_argument("--no-reuse", action="store_true",
                    help="evaluate the teacher-forced sequence from an empty cache (slower; the rows are the same)")
    args = ap.parse_args()
    import llama_cpp

    with gzip.open(args.prompts, "rt", encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    if args.ids:
        by_id = {p["id"]: p for p in prompts}
        prompts = [by_id[int(i)] for i in args.ids.split(",")]
    if args.limit:
        prompts = prompts[:args.limit]
    settings = {"n_ctx": args.n_ctx, "n_batch": args.n_batch, "gen": args.gen, "threads": args.threads,
                "llama_cpp_python": llama_cpp.__version__}
    ppl, ppl_rows = {}, []
    want_rows = {}
    for spec in args.ppl_rows:
        text, _, chunk = spec.rpartition(":")
        want_rows.setdefault(text, set()).add(int(chunk))
    if args.ppl_text:  # llama-perplexity's own context: n_ctx = the chunk length
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.ppl_ctx, n_batch=args.ppl_ctx,
                              n_ubatch=args.ppl_ctx, n_threads=args.threads, logits_all=True, verbose=False)
        for path in args.ppl_text:
            with open(path, encoding="utf-8") as f:
                name = path.rsplit("/", 1)[-1]
                value, running, chunk_nll, rows, n_chunks, n_tokens = perplexity(
                    llm, f.read(), args.ppl_ctx, want_rows.get(name, ()))
            ppl[name] = {"ppl": value, "running": running, "chunk_nll": chunk_nll, "n_ctx": args.ppl_ctx,
                         "chunks": n_chunks, "tokens": n_tokens, "row_chunks": {}}
            for c, hashes in sorted(rows.items()):  # rows [start, end) of ppl_row_sha256
                start = sum(len(h) for h in ppl_rows)
                ppl[name]["row_chunks"][str(c)] = [start, start + len(hashes)]
                ppl_rows.append(hashes)
            print(f"perplexity {path}: {value:.4f} ({n_chunks} chunks of {args.ppl_ctx}, {n_tokens} tokens)",
                  flush=True)
        del llm
    if args.ppl_only:
        with np.load(args.out) as old:
            kept = {k: old[k] for k in old.files}
        kept["perplexity"] = np.asarray(json.dumps(ppl))
        kept["ppl_row_sha256"] = _hash_array([h for hashes in ppl_rows for h in hashes])
        tmp = f"{args.out}.tmp.npz"
        np.savez_compressed(tmp, **kept)
        os.replace(tmp, args.out)
        print(f"perplexity of {len(ppl)} texts -> {args.out} (prompts kept)")
        return
    done = []
    if args.add and os.path.exists(args.out):
        done, old_ppl, old_rows = load_recorded(args.out)
        if not args.ppl_text:
            ppl, ppl_rows = old_ppl, old_rows
        have = {entry[0] for entry in done}
        prompts = [p for p in prompts if p["id"] not in have]
        print(f"{len(done)} prompts kept from {args.out}, {len(prompts)} to record", flush=True)
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_ubatch=args.n_batch,
                          n_threads=args.threads, logits_all=True, verbose=False)
    eog = eog_ids(llama_cpp, llm)
    t0 = time.time()
    for k, p in enumerate(prompts):
        if p["kind"] == "chat" and "tokenizer.chat_template" not in llm.metadata and not builtin_template(llm):
            print(f"prompt {p['id']}: a chat, and the file has no chat template: skipped", flush=True)
            continue
        text = render_chat(llama_cpp, llm, p["messages"]) if p["kind"] == "chat" else p["text"]
        ids = tokenize(llm, text)
        budget = args.n_ctx - args.gen
        if len(ids) > budget:
            ids = ids[:budget]
        t1 = time.time()
        done.append((p["id"],) + record_prompt(llm, ids, args.gen, eog, args.n_batch, reuse=not args.no_reuse))
        print(f"prompt {p['id']}: {len(ids)} + {len(done[-1][1]) - len(ids)} tokens, {time.time() - t1:.1f} s",
              flush=True)
        if args.checkpoint and (k + 1) % args.checkpoint == 0 and k + 1 < len(prompts):
            save(args.out, done, settings, ppl, ppl_rows)
    n_forced, n_decode, n_tokens = save(args.out, done, settings, ppl, ppl_rows)
    print(f"{len(done)} prompts, {n_forced} teacher-forced rows, {n_decode} decode rows, {n_tokens} tokens, "
          f"{time.time() - t0:.0f} s -> {args.out}")


def _hash_array(hashes):
    return np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, 32)


def load_recorded(path):
    """The entries save() wrote, back as (done, perplexity, ppl row hashes) for --add."""
    with np.load(path) as z:
        offsets, tokens, plens = z["seq_offsets"], z["seq_tokens"], z["prompt_len"]
        forced, decode = [bytes(h) for h in z["forced_sha256"]], [bytes(h) for h in z["decode_sha256"]]
        done, f, d = [], 0, 0
        for i, pid in enumerate(z["prompt_id"]):
            seq = tokens[offsets[i]:offsets[i + 1]].tolist()
            n_dec = len(seq) - int(plens[i])  # one decode row per generated token
            done.append((int(pid), seq, int(plens[i]), forced[f:f + len(seq)], decode[d:d + n_dec],
                         z["last_prompt_top_ids"][i], z["last_prompt_top_logits"][i]))
            f, d = f + len(seq), d + n_dec
        assert f == len(forced) and d == len(decode), "row counts do not add up"
        ppl = json.loads(str(z["perplexity"]))
        flat = [bytes(h) for h in z["ppl_row_sha256"]]
    rows, start = [], 0
    for text in ppl.values():  # back into per-chunk lists, in the order save() laid them out
        for c, (a, b) in sorted(text.get("row_chunks", {}).items(), key=lambda kv: kv[1][0]):
            rows.append(flat[a:b])
            start = b
    assert start == len(flat), "perplexity rows do not add up"
    return done, ppl, rows


def save(out_path, done, settings, ppl, ppl_rows=()):
    """Write the prompts recorded so far, in prompt id order; returns (forced rows, decode rows, tokens)."""
    done = sorted(done, key=lambda entry: entry[0])
    pids, seqs, prompt_lens, forced, decode, top_ids, top_logits = zip(*done)
    forced = [h for hashes in forced for h in hashes]
    decode = [h for hashes in decode for h in hashes]
    out = {
        "prompt_id": np.asarray(pids, np.int32),
        "seq_offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
        "seq_tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "prompt_len": np.asarray(prompt_lens, np.int32),
        "forced_sha256": np.frombuffer(b"".join(forced), np.uint8).reshape(-1, 32),
        "decode_sha256": np.frombuffer(b"".join(decode), np.uint8).reshape(-1, 32),
        "last_prompt_top_ids": np.stack(top_ids),
        "last_prompt_top_logits": np.stack(top_logits),
        "settings": np.asarray(json.dumps(settings)),
        "perplexity": np.asarray(json.dumps(ppl)),
        "ppl_row_sha256": _hash_array([h for hashes in ppl_rows for h in hashes]),
    }
    tmp = f"{out_path}.tmp.npz"
    np.savez_compressed(tmp, **out)
    os.replace(tmp, out_path)
    return len(forced), len(decode), sum(len(s) for s in seqs)


if __name__ == "__main__":
    main()
