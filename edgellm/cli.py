"""The `edgellm` command: a thin shell over the Python API. Errors print one line and exit non-zero.

Subcommands: pull, models, rm, run, chat (an interactive loop over Model.chat), batch (a JSONL file through the batch
engine, or Ray Data), embed, info, warmup, serve (the HTTP server, an optional extra; or Ray Serve replicas), plus
quantize/convert/perplexity from edgellm/prep/cli.py when that module is present.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time

import edgellm
from edgellm.errors import EdgeLLMError, GrammarError, PromptError
from edgellm.store import catalog, hub

DEFAULT_PROMPT = "The capital of France is"


def _add_model_arg(p, optional=True):
    p.add_argument("model", nargs="?" if optional else None, default=None,
                   help="catalog name (see `edgellm models`) or path to a .gguf file; default: the catalog default")


def _add_load_args(p):
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: physical cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens (default: the largest that fits in free memory, at most the "
                        "model's training context)")
    p.add_argument("-ctk", "--kv-type", choices=("f32", "f16", "q8_0"), default=None,
                   help="KV cache storage (default f16, as llama.cpp)")
    p.add_argument("--keep", type=int, default=None,
                   help="positions kept when a full context shifts (attention sinks, default 4)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="cpu (default), cuda (an NVIDIA GPU; pip install 'edgellm[cuda]') or auto (the GPU if usable)")


def _add_sampling_args(p):
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--typical-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None)
    p.add_argument("--repeat-last-n", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    # structured output, llama.cpp's flags: the output is constrained to a GBNF grammar or a JSON Schema
    p.add_argument("--grammar", default=None, help="GBNF grammar text the output must match")
    p.add_argument("--grammar-file", default=None, help="read the GBNF grammar from a file")
    p.add_argument("-j", "--json-schema", default=None, help="JSON Schema (text) the output must match")
    p.add_argument("-jf", "--json-schema-file", default=None, help="read the JSON Schema from a file")


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise GrammarError(f"cannot read the {what} file {path!r}: {e.strerror}") from None


def _constraint_kwargs(args) -> dict:
    grammar = args.grammar if args.grammar is not None else (
        _read_text(args.grammar_file, "grammar") if args.grammar_file else None)
    schema = args.json_schema if args.json_schema is not None else (
        _read_text(args.json_schema_file, "JSON Schema") if args.json_schema_file else None)
    kw = {}
    if grammar is not None:
        kw["grammar"] = grammar
    if schema is not None:
        kw["json_schema"] = schema
    return kw


def _sampling_kwargs(args) -> dict:
    names = ("top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
             "frequency_penalty")
    kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    kw.update(temperature=args.temp, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    kw.update(_constraint_kwargs(args))
    from edgellm.generation.options import parse_options  # start-up time: only commands that generate load it
    parse_options("edgellm", kw, {})  # bad values fail here, before a model is loaded
    return kw


COMPILE_NOTE = ("edgellm: compiling kernels for this CPU (first run only, about a minute; `edgellm warmup` does it "
                "ahead of time)...")


class CompileReport:
    """Kernel compilation on stderr: a line when it starts and one when it ends, in logs as on a terminal
    (llama.cpp's users read its load log there); on a terminal, a live count and elapsed time in between."""

    def __init__(self, stream=None, note=COMPILE_NOTE):
        self.stream, self.note = stream or sys.stderr, note
        self.live = self.stream.isatty() and os.environ.get("TERM") != "dumb"  # redraws need \r and erase-line
        self.kernels, self.t0 = 0, 0.0
        self._stop = threading.Event()
        self._ticker = None

    def __call__(self, p) -> None:  # edgellm.engine.compile_clock.CompileProgress
        if p.stage == "start":
            self.t0 = time.perf_counter()
            self._write(self.note + "\n")
            if self.live:  # a chat's later prompt can compile again: a fresh stop flag each time
                self._stop = threading.Event()
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()
        elif p.stage == "kernel":
            self.kernels = p.kernels
        else:
            self.close()
            self._write(("\r\033[K" if self.live else "")
                        + f"edgellm: compiled {p.kernels} kernels in {p.seconds:.1f} s\n")

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    def _tick(self):
        while not self._stop.wait(0.5):
            self._write(f"\r  {self.kernels} kernels compiled, {time.perf_counter() - self.t0:.0f} s")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must not stop the model


def _load(args):
    speculative = {}  # (run's options: speculative decoding)
    if getattr(args, "draft_model", None) or getattr(args, "lookup", False):
        speculative = {"draft_model": args.draft_model, "speculative": "draft" if args.draft_model else "lookup"}
    return edgellm.load(args.model, n_threads=args.threads, n_ctx=args.ctx_size, device=args.device,
                        kv_type=args.kv_type, n_keep=args.keep, **speculative)


def _max_tokens(n_predict: int):
    return None if n_predict < 0 else n_predict  # -1: until end-of-generation or a full context, as llama.cpp


def _mb(n) -> str:
    return f"{n / 1e6:9.1f} MB" if n is not None else "        ? MB"


def cmd_pull(args) -> int:
    for name in args.names or [catalog.DEFAULT_MODEL]:
        ref = hub.parse_ref(name)
        if ref is None:
            if args.dry_run:
                entry = catalog.lookup(name)
                present = dict((e.name, ok) for e, ok in catalog.list_models(args.dir))[entry.name]
                print(f"{entry.name}: {entry.file} {_mb(entry.size).strip()}, "
                      + ("cached, nothing to download" if present else f"would download {_mb(entry.size).strip()}"))
                continue
            print(catalog.pull(name, args.dir))
        elif ref.quant is None and ref.filename is None and not args.dry_run:
            _list_repo(hub.list_files(ref.repo_id, ref.revision))
        elif args.dry_run:
            p = hub.plan(ref)
            for f, cached in zip(p.files, p.cached):
                print(f"{ref.repo_id}/{f.path} {_mb(f.size)}  {'cached' if cached else 'would download'}")
            print(f"{len(p.files)} file(s), {p.total_bytes / 1e6:,.1f} MB; to download: "
                  f"{sum(c is None for c in p.cached)} file(s), {p.download_bytes / 1e6:,.1f} MB")
        else:
            print(hub.pull(ref, check_memory=not args.no_check))
    return 0


def _list_repo(listing) -> None:
    models = listing.models()
    try:
        default = hub.choose(listing)[0].path if models else None
    except hub.HubError:
        default = None
    print(f"{listing.repo_id}: {len(models)} GGUF model(s){' (from the cache: the Hub is not reachable)' if listing.source == 'cache' else ''}")
    for group in models:
        size = sum(f.size or 0 for f in group)
        parts = f" ({len(group)} parts)" if len(group) > 1 else ""
        mark = "*" if group[0].path == default else " "
        print(f"{mark} {group[0].quant or '-':<10} {_mb(size)}  {group[0].path}{parts}")
    if models:
        print(f"pull one with: edgellm pull {listing.repo_id}:QUANT (* is what {listing.repo_id} alone loads)")


def cmd_models(args) -> int:
    for entry, present in catalog.list_models(args.dir):
        mark = "cached" if present else "-"
        default = " (default)" if entry.name == catalog.DEFAULT_MODEL else ""
        print(f"{entry.name:<16} {entry.size / 1e6:7.1f} MB  {mark:<7} {entry.description}{default}")
    for m in hub.cached_models():
        parts = f", {m.parts} parts" if m.parts > 1 else ""
        print(f"{m.name}  {m.size / 1e6:7.1f} MB  hub-cache{parts}")
    for path, size in catalog.local_files(args.dir):
        print(f"{path}  {size / 1e6:7.1f} MB  local")
    return 0


def cmd_rm(args) -> int:
    status = 0
    for name in args.names:
        if hub.parse_ref(name) is not None:
            removed = hub.remove(name)
        else:
            removed = catalog.remove_any(name, args.dir)
        if removed:
            for r in removed:
                print(f"removed {r}")
        else:
            print(f"edgellm: error: {name!r} is not in the cache", file=sys.stderr)
            status = 1
    return status


def cmd_run(args) -> int:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    sampling = _sampling_kwargs(args)
    m = _load(args)
    # A cold cache compiles this prompt's kernels when it runs (the other prompt shapes are left for when they
    # are needed), reported before any text; the echo waits for the first piece so the two do not interleave.
    report = m.compile_progress = CompileReport()
    stream = m.stream(prompt, max_tokens=_max_tokens(args.n_predict), **sampling)  # checks the prompt
    out, echo = sys.stdout, prompt if args.echo else ""
    try:
        for piece in stream:
            out.write(echo + piece)
            out.flush()
            echo = ""
    finally:
        report.close()
    out.write(echo + "\n")
    print(m.timings.summary(), file=sys.stderr)
    return 0


CHAT_HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit; " \
            "Ctrl-C stops a reply, Ctrl-D leaves"


def _chat_messages(system, history):
    return ([{"role": "system", "content": system}] if system else []) + history


def _catch_ctrl_c():
    """Make Ctrl-C raise KeyboardInterrupt even where SIGINT arrived ignored: a process started as a background
    job of a non-interactive shell (`cmd &` in a script, some launchers) inherits SIG_IGN, Python then keeps it,
    and Ctrl-C in the chat would do nothing. The chat promises that Ctrl-C stops a reply, so it takes the signal
    back whenever it talks to a terminal."""
    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_chat(args) -> int:
    """An interactive chat: history kept across turns; Ctrl-C ends the current reply, not the session."""
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    _catch_ctrl_c()
    sampling, max_tokens = _sampling_kwargs(args), _max_tokens(args.n_predict)
    m = _load(args)
    # A cold cache compiles every prompt shape (and sampling, when it samples) before the first "> ", since a
    # chat's prompts grow turn by turn and a compile line must not land inside a reply; anything left still says so.
    report = m.compile_progress = CompileReport()
    try:
        m.precompile(("prompt", "sampling") if args.temp > 0 else ("prompt",), report)
    finally:
        report.close()
    system, history = args.system, []
    print(f"edgellm chat: {m.name}. {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-C stops a reply; /exit or Ctrl-D leaves)")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = []
            print("(conversation cleared)")
            continue
        if text == "/system" or text.startswith("/system "):
            system = text[len("/system"):].strip() or None
            history = []
            print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)")
            continue
        if text.startswith("/") and " " not in text:
            print(f"(unknown command {text}; {CHAT_HELP})")
            continue
        history.append({"role": "user", "content": line})
        pieces, interrupted = [], False
        try:
            for piece in m.chat(_chat_messages(system, history), max_tokens=max_tokens, stream=True, **sampling):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            interrupted = True  # the model reset its cache bookkeeping: the next turn starts clean
        except PromptError as e:
            history.pop()
            print(f"edgellm: error: {e}; /reset to start over", file=sys.stderr)
            continue
        except EdgeLLMError as e:
            history.pop()
            print(f"edgellm: error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": "".join(pieces)})
        print(" [interrupted]" if interrupted else "")
        if args.show_stats and not interrupted:
            t = m.timings
            print(f"[prompt {t.prompt_tokens} tokens | reply {t.generated_tokens} tokens, "
                  f"{t.generate_tps:.1f} t/s]", file=sys.stderr)


EMBED_FORMATS = ("array", "jsonl", "openai")


def _embed_inputs(args) -> list:
    """The texts to embed: each -p, then each non-blank line of -f (- for standard input)."""
    texts = list(args.prompt or [])
    if args.file is not None:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        texts += [line for line in lines if line.strip()]
    if not texts:
        raise PromptError("nothing to embed: give -p TEXT (repeatable) or -f FILE (one input a line, - for stdin)")
    return texts


def cmd_embed(args) -> int:
    """Embedding vectors on standard output (llama.cpp's llama-embedding): the inputs are all read before the model
    loads, and nothing is printed unless every one was embedded."""
    texts = _embed_inputs(args)
    m = _load(args)
    if args.format == "openai":
        out = [json.dumps(m.create_embedding(texts, pooling=args.pooling, normalize=args.normalize))]
    else:
        vectors = m.embed(texts, pooling=args.pooling, normalize=args.normalize)
        out = [json.dumps(vectors)] if args.format == "array" else [
            json.dumps({"index": i, "input": text, "embedding": v}) for i, (text, v) in enumerate(zip(texts, vectors))]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def cmd_warmup(args) -> int:
    from edgellm.prep.warmup import warmup  # start-up time: each subcommand imports only what it runs
    report = CompileReport(note="edgellm: compiling kernels for this CPU...")
    try:
        warmup(args.models, n_threads=args.threads, log=lambda msg: print(msg, flush=True), progress=report)
    finally:
        report.close()
    return 0


RAY_SERVE_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests")


def _replica_scaling(args) -> dict:
    """serve --ray's replica options as serve_deployment's arguments, checked before Ray starts."""
    given = [name for name in RAY_SERVE_FLAGS if getattr(args, name) is not None]
    def named(names):
        return ", ".join("--" + name.replace("_", "-") for name in names) + (" sets" if len(names) == 1 else " set")
    if args.ray is None:
        if given:
            raise ValueError(f"{named(given)} Ray Serve replicas: add --ray [ADDRESS]")
        return {}
    if args.cache_dir is not None:
        raise ValueError("--cache-dir is one server's directory: with --ray each replica keeps its prompt cache in "
                         "RAM (--cache-ram)")
    if args.device != "cpu":
        raise ValueError(f"--ray runs replicas on CPU cores (the threads rule reserves them), not --device "
                         f"{args.device}")
    if args.replicas is not None:
        if len(given) > 1:
            raise ValueError(f"--replicas fixes the number of replicas; {named(given[1:])} autoscaling: give one "
                             "or the other")
        return {"replicas": args.replicas}
    if not given:
        return {"replicas": 1}
    if args.max_replicas is None:
        raise ValueError(f"{named(given)} autoscaling: give --max-replicas too (or --replicas N for a fixed "
                         "number)")
    low = 1 if args.min_replicas is None else args.min_replicas
    if low > args.max_replicas:
        raise ValueError(f"--min-replicas ({low}) is more than --max-replicas ({args.max_replicas})")
    if args.target_ongoing_requests is not None and low == args.max_replicas:
        raise ValueError(f"--target-ongoing-requests needs room to scale: --max-replicas ({args.max_replicas}) "
                         f"must be more than --min-replicas ({low})")
    scaling = {"min_replicas": low, "max_replicas": args.max_replicas}
    if args.target_ongoing_requests is not None:
        scaling["target_ongoing_requests"] = args.target_ongoing_requests
    return scaling


def _serve_on_ray(args, scaling: dict) -> int:
    from edgellm.server import check_serve_options  # an optional extra (starlette), as for serve without --ray
    key, limits, speculative = check_serve_options(args.api_key, args.api_key_file, args.max_tokens,
                                                   args.request_timeout, args.lookup, args.draft_model)
    try:
        from edgellm.integrations.ray import run_serve  # an optional extra (ray[serve])
        importlib.import_module("ray.serve")  # the extra's Serve part, checked before anything starts
    except ImportError as e:
        raise EdgeLLMError(f"--ray needs its optional dependencies ({e.name or e}); "
                           "install them with: pip install 'edgellm[ray]'") from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(f"edgellm: warning: serving on {args.host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    app_options = dict(limits=limits, speculative=speculative, host=args.host,
                       max_request_bytes=args.max_request_bytes, max_queue=args.max_queue,
                       cors_origins=args.cors_origin or (), parallel=args.parallel, cache_ram=args.cache_ram,
                       draft_max=args.draft_max)
    return run_serve(args.model, address=args.ray, host=args.host, port=args.port, n_threads=args.threads,
                     api_key=key, app_options=app_options, n_ctx=args.ctx_size, kv_type=args.kv_type,
                     n_keep=args.keep, draft_model=args.draft_model, speculative=speculative, **scaling)


def cmd_serve(args) -> int:
    scaling = _replica_scaling(args)
    if args.ray is not None:
        return _serve_on_ray(args, scaling)
    try:
        from .server import serve  # an optional extra (starlette, uvicorn)
    except ImportError as e:
        raise EdgeLLMError(f"the server needs its optional dependencies ({e.name or e}); "
                           "install them with: pip install 'edgellm[server]'") from None
    report = CompileReport()
    try:
        return serve(args.model, host=args.host, port=args.port, api_key=args.api_key, n_ctx=args.ctx_size,
                     n_threads=args.threads, max_request_bytes=args.max_request_bytes, compile_progress=report,
                     api_key_file=args.api_key_file, kv_type=args.kv_type, n_keep=args.keep, device=args.device,
                     max_tokens=args.max_tokens, request_timeout=args.request_timeout, max_queue=args.max_queue,
                     cors_origins=args.cors_origin or (), parallel=args.parallel, cache_ram=args.cache_ram,
                     cache_dir=args.cache_dir, lookup=args.lookup, draft_model=args.draft_model,
                     draft_max=args.draft_max)
    finally:
        report.close()


def cmd_batch(args) -> int:
    from edgellm.generation import jobs  # start-up time: each subcommand imports only what it runs
    defaults = {**_sampling_kwargs(args), "max_tokens": _max_tokens(args.n_predict)}
    load = dict(n_threads=args.threads, n_ctx=args.ctx_size, kv_type=args.kv_type, n_keep=args.keep)
    if args.ray is not None:
        try:
            from edgellm.integrations.ray import ray_executor  # an optional extra (ray[data])
        except ImportError as e:
            raise EdgeLLMError(f"--ray needs its optional dependencies ({e.name or e}); "
                               "install them with: pip install 'edgellm[ray]'") from None
        execute = ray_executor(args.model, defaults, address=args.ray, actors=args.actors, n_parallel=args.parallel,
                               **load)
    else:
        m = _load(args)
        m.compile_progress = CompileReport()
        execute = jobs.local_executor(m, defaults, args.parallel)
    s = jobs.run_file(args.input, args.output, execute, progress=not args.no_progress)
    print(f"edgellm: {s.lines} lines written ({s.errors} errors), {s.skipped} already in {args.output}; "
          f"{s.completion_tokens} tokens in {s.seconds:.1f} s, {s.tokens_per_s:.1f} tok/s (first record after "
          f"{s.first_record_s:.1f} s)", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from edgellm.prep.info import describe  # start-up time: each subcommand imports only what it runs
    print(describe(args.model, n_ctx=args.ctx_size, kv_type=args.kv_type))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _byte_size(text: str) -> int:
    """'512M', '2G', '1.5G', '1000000' as bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M or 2G, got {text!r}")
    return int(value * units[unit])


def _int_list(text: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None


def cmd_bench(args) -> int:
    if args.lookup or args.draft_model:
        return _bench_speculative(args)
    from edgellm.prep import bench  # start-up time: each subcommand imports only what it runs
    compiling = CompileReport()
    try:
        report = bench.bench(args.model, n_prompt=args.n_prompt, n_gen=args.n_gen, depths=args.depth,
                             threads=args.threads or [None], repeats=args.repetitions, profile=args.profile,
                             batches=args.batch, compile_progress=compiling,
                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    finally:
        compiling.close()
    print(bench.to_json(report) if args.output == "json" else bench.to_markdown(report))
    if args.plot:
        bench.plot(report, args.plot)
    return 0


def _bench_speculative(args) -> int:
    """The speculative task set (edgellm.prep.speculative_bench): t/s with and without, acceptance, identical."""
    from edgellm.prep import speculative_bench  # start-up time: each subcommand imports only what it runs
    threads = (args.threads or [None])[0]
    m = edgellm.load(args.model, n_threads=threads, draft_model=args.draft_model)
    mode = "draft" if args.draft_model else "lookup"
    rows = speculative_bench.bench(m, mode, n_gen=args.n_gen[0], repeats=args.repetitions,
                                   log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(speculative_bench.to_markdown(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgellm", description="CPU-first quantized LLM inference (GGUF models)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch catalog or Hugging Face Hub models into the cache")
    p.add_argument("names", nargs="*", help="catalog names, or Hub names: org/repo (lists its GGUF files), "
                                            "org/repo:QUANT, org/repo/file.gguf (default: the default model)")
    p.add_argument("--dir", default=None, help="cache directory of catalog models (default: $EDGELLM_MODELS or "
                                               "~/.cache/edgellm/models; Hub models go to the Hugging Face cache)")
    p.add_argument("--dry-run", action="store_true", help="show what would be downloaded and how big, download nothing")
    p.add_argument("--no-check", action="store_true", help="skip the memory check before a Hub download")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list the catalog, Hub-cached and local models with their sizes")
    p.add_argument("--dir", default=None)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("rm", help="remove models from the cache (a catalog name, org/repo, org/repo:QUANT, "
                                  "org/repo/file.gguf, or a file in the models directory)")
    p.add_argument("names", nargs="+")
    p.add_argument("--dir", default=None)
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("run", help="generate text from a prompt, streaming it to the terminal")
    _add_model_arg(p)
    p.add_argument("-p", "--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64; -1: no limit)")
    p.add_argument("--no-echo", dest="echo", action="store_false", help="do not print the prompt first")
    p.add_argument("--lookup", action="store_true",
                   help="speculative decoding with prompt lookup: drafts copied from the prompt and output so far")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="speculative decoding with this smaller model of the same vocabulary drafting")
    _add_load_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="an interactive chat in the terminal, using the model's chat template")
    _add_model_arg(p)
    p.add_argument("-s", "--system", default=None, help="system prompt (also settable in the chat with /system)")
    p.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (default 512; -1: no limit)")
    p.add_argument("--show-stats", action="store_true", help="print token counts and speed after each reply")
    _add_load_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("batch", help="a JSONL file of prompts or chats through the batch engine, resumable, "
                                     "in this process or on Ray (--ray)")
    p.add_argument("input", help="JSONL: one {\"prompt\": ...} or {\"messages\": [...]} per line, optional \"id\" "
                                 "and per-line options (max_tokens, temperature, response_format, ...)")
    p.add_argument("output", help="JSONL of records (index, id, text, finish_reason, usage); appended: lines it "
                                  "already has are skipped")
    p.add_argument("-m", "--model", default=None, help="catalog name or .gguf path (default: the catalog default)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per line unless the line says "
                                                                   "max_tokens (default 128; -1: no limit)")
    p.add_argument("--parallel", type=int, default=16, help="sequences decoded together per model (default 16)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray Data: a cluster's address (e.g. auto or ray://host:10001), or none to start a "
                        "local one (needs the edgellm[ray] extra)")
    p.add_argument("--actors", type=int, default=None,
                   help="with --ray: model replicas (default: one per node); each gets the node's cores / its "
                        "actors on that node as threads, unless -t says")
    _add_load_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("embed", help="embedding vectors of texts as JSON (llama-embedding): pooled hidden states, "
                                     "L2-normalised")
    _add_model_arg(p)
    p.add_argument("-p", "--prompt", action="append", default=None, help="a text to embed (repeatable)")
    p.add_argument("-f", "--file", default=None, help="embed each non-blank line of this file (- for stdin)")
    p.add_argument("--pooling", choices=("mean", "last", "none"), default="mean",
                   help="mean of the tokens' vectors (default), the last token's, or none: a vector per token")
    p.add_argument("--no-normalize", dest="normalize", action="store_false", help="leave the vectors unscaled")
    p.add_argument("--format", choices=EMBED_FORMATS, default="array",
                   help="array: one JSON array of the vectors (default); jsonl: a line per input with its index, "
                        "text and vector; openai: OpenAI's embedding response")
    _add_load_args(p)
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("info", help="metadata, tensor types and sizes, and the memory plan")
    _add_model_arg(p)
    p.add_argument("-c", "--ctx-size", type=int, default=None)
    p.add_argument("-ctk", "--kv-type", choices=("f32", "f16", "q8_0"), default=None)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("warmup", help="compile the kernels ahead of time (e.g. after install), so later runs "
                                      "start from Numba's on-disk cache")
    p.add_argument("models", nargs="*", help="catalog names or .gguf paths (default: the catalog default)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: physical cores)")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the edgellm[server] extra)")
    _add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require this key as a Bearer token (all endpoints but /health); "
                                                   "visible in ps: prefer --api-key-file or $EDGELLM_API_KEY")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens one request may generate: more is refused (default: what the context holds)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a generation may run before it is ended (default: no limit)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for the model; more get 503 "
                                                             "(default 64)")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="a web origin allowed to call the server from a browser, e.g. http://localhost:3000 "
                        "(repeatable; default none)")
    p.add_argument("-np", "--parallel", type=_positive_int, default=None,
                   help="requests decoded together (continuous batching; default: what free memory holds, at most 8)")
    p.add_argument("--cache-ram", type=_byte_size, default=None,
                   help="RAM for the prompt cache of recent conversations, e.g. 512M, 2G, 0 to disable (default 1G)")
    p.add_argument("--cache-dir", default=None, help="also keep the prompt cache in this directory, across restarts")
    p.add_argument("--lookup", action="store_true",
                   help="speculative decoding with prompt lookup: drafts copied from the prompt and output so far")
    p.add_argument("-md", "--draft-model", default=None, metavar="MODEL",
                   help="speculative decoding with this smaller model of the same vocabulary drafting")
    p.add_argument("--draft-max", "--draft", type=_positive_int, default=None, metavar="N",
                   help="most tokens drafted per step (default 12 for --lookup, 6 for a draft model)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve on Ray Serve replicas behind one address: a cluster's (e.g. auto or "
                        "ray://host:10001), or none to start a local one (needs the edgellm[ray] extra)")
    p.add_argument("--replicas", type=_positive_int, default=None,
                   help="with --ray: a fixed number of replicas (default 1); each gets the node's cores / its "
                        "replicas on that node as threads, unless -t says")
    p.add_argument("--min-replicas", type=_count, default=None,
                   help="with --ray: autoscaling's fewest replicas (default 1)")
    p.add_argument("--max-replicas", type=_positive_int, default=None,
                   help="with --ray: autoscaling's most replicas (threads per replica are sized for this many)")
    p.add_argument("--target-ongoing-requests", type=_positive_float, default=None, metavar="N",
                   help="with --ray: autoscaling adds replicas while requests running or queued per replica "
                        "average more than N, and removes them as that falls (default 2)")
    _add_load_args(p)
    p.set_defaults(func=cmd_serve)

    try:  # quantize / convert / perplexity live in their own module, present in full installs
        from edgellm.prep.cli import add_subcommands
    except ModuleNotFoundError as e:
        if e.name != "edgellm.prep.cli":
            raise  # the module is there but broken: say so rather than hide its subcommands
    else:
        add_subcommands(sub)
    p = sub.add_parser("bench", help="llama-bench-style throughput: pp, tg at depth, thread sweeps, bandwidth share")
    _add_model_arg(p)
    p.add_argument("-p", "--n-prompt", type=_int_list, default=[128], help="prompt sizes, comma list (default 128)")
    p.add_argument("-n", "--n-gen", type=_int_list, default=[128], help="generation sizes (default 128)")
    p.add_argument("-d", "--depth", type=_int_list, default=[0], help="tokens already in the cache for tg (default 0)")
    p.add_argument("-t", "--threads", type=_int_list, default=None, help="thread counts (default: physical cores)")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-b", "--batch", type=_int_list, default=[],
                   help="sequences decoded together, comma list (e.g. 1,2,4,8,16): aggregate and per-sequence t/s")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md")
    p.add_argument("--profile", action="store_true", help="time per operation type and layer (where supported)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the roofline (needs matplotlib)")
    p.add_argument("--lookup", action="store_true", help="instead: the speculative task set, prompt lookup against "
                   "plain decoding (t/s, speed-up, acceptance, identical output); -n sets the tokens per task")
    p.add_argument("--draft-model", default=None, metavar="MODEL", help="instead: the speculative task set, this "
                   "model drafting against plain decoding")
    p.set_defaults(func=cmd_bench)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgeLLMError as e:
        print(f"edgellm: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `edgellm run ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 1
    except (ValueError, OSError, MemoryError) as e:
        print(f"edgellm: error: {e or type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nedgellm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
