"""The Python API: `edgellm.load(...)` returns a `Model` that tokenizes, scores, generates and chats.

Sections: loading; tokens; logits and the KV-cache prefix reuse; session state; one call at a time; the decode loop
(`decode_events`, shared by every generating call, its per-token logic in edgellm/generation/decoding.py); generate /
complete / stream; batches (edgellm/generation/batch.py); chat; the llama-cpp-python-shaped calls (create_completion,
create_chat_completion, in edgellm/compat/llama_compat.py). The result types are in edgellm/generation/results.py.

Threads: one call runs at a time. A call marks the model busy under a short-held Condition rather than holding a
lock for its whole length, because a stream is a generator that may be stepped, closed or garbage-collected on
any thread. A call that finds the model busy waits, unless its own thread is the one that last stepped the busy
stream: that stream could never finish while it waits, so it gets ModelBusyError. `cancel()` ends the call in
flight between prompt batches or decode steps.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
import warnings

import numpy as np

from edgellm.compat.chat import chat_template_from_metadata
from edgellm.engine import gguf as gguf_reader
from edgellm.engine import prefix, validate
from edgellm.engine.compile_clock import compile_seconds, reporting_compiles
from edgellm.engine.cuda import build_cuda_model, resolve_device
from edgellm.errors import (Cancelled, EdgeLLMError, ModelBusyError, ModelError, NumericalError,  # noqa: F401
                            PromptError, SamplingError)  # (NumericalError, SamplingError: this module's API)
from edgellm.generation import kernel_paths
from edgellm.generation.batch import prepare, release_pool, run_batch
from edgellm.generation import cost_store, speculative as speculative_mod
from edgellm.generation.decoding import (PromptScore, SequenceState, check_finite, logit_bias_arrays,
                                         max_new_tokens)
from edgellm.generation.options import MODEL_DEFAULT, GenerationOptions, parse_options
from edgellm.generation.prompt_cache import PromptCache
from edgellm.generation.sampling import Sampler
from edgellm.generation.results import Completion, Timings, TokenInfo  # noqa: F401  (part of this module's API)
from edgellm.generation.results import PromptScored
from edgellm.generation.state import ModelState
from edgellm.tokenizer import Tokenizer

EMPTY_SLOT = -1  # kvcache.EMPTY_SLOT: a slot that holds no position


class ContextShiftWarning(UserWarning):
    """A prompt longer than the context: it was processed through the shifting cache, its middle dropped."""



def default_threads() -> int:
    """Physical cores (hyper-threads share the memory bus a decode step is bound by), at least one."""
    try:
        import psutil  # on first use: the API module imports without it (start-up time)
        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil can fail inside some containers
        n = None
    return max(1, n or os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------

class Model:
    """A loaded model. Calls from several threads run one after another (see the module docstring)."""

    def __init__(self, model=None, n_threads: int | None = None, n_ctx: int | None = None,
                 models_dir: str | None = None, verbose: bool = False, device: str = "cpu",
                 check_memory: bool = True, kv_type: str | None = None, n_keep: int | None = None,
                 context_shift: bool = True, precompile=(), compile_progress=None, draft_model=None,
                 speculative="auto", prompt_cache=None):
        """n_ctx None: the largest context that fits in free memory (validate.fit_context), at most the trained one.
        kv_type: KV cache storage, "f16" (default, as llama.cpp), "f32" or "q8_0". A full context shifts (unless
        context_shift=False): the first n_keep positions (default 4) stay and the oldest half of the rest goes.
        precompile, compile_progress: see precompile(), run at load when paths are given. Kernels not compiled
        ahead compile on first use, also kept out of the prompt and generation times (timings.compile_s).
        speculative: the generating calls' default speculative decoding (docs/speculative.md), None (off),
        "lookup" (drafts from the prompt and output so far) or "draft" (drafts by draft_model, a smaller model of
        the same vocabulary: a catalog name, path or Model); "auto": "draft" with a draft_model, else None.
        Each call can override it with speculative=.
        prompt_cache: a RAM budget in bytes (or an edgellm.generation.prompt_cache.PromptCache) for the KV prefixes
        of earlier conversations, so that alternating chats re-use their prefixes instead of evicting each other."""
        t0 = time.perf_counter()
        device = resolve_device(device)  # DeviceError here, before the file is read
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if n_keep is not None and (isinstance(n_keep, bool) or not isinstance(n_keep, int) or n_keep < 0):
            raise ValueError(f"n_keep must be a non-negative integer, got {n_keep!r}")
        from edgellm.engine.kvtypes import kv_type as parse_kv_type  # kernels: slow to import, loaded with a model
        kv_name = "f32" if device == "cuda" and kv_type is None else parse_kv_type(kv_type).name  # ValueError
        from edgellm.store import catalog  # start-up time: imported on use, as the lines below
        path = catalog.resolve(model, models_dir, n_ctx=n_ctx, kv_type=kv_name, check_memory=check_memory)
        gguf_file = gguf_reader.open(path)
        self.context_fit = None
        try:  # refuse up front, with the figures, what cannot fit (check_memory=False overrides)
            if n_ctx is None and check_memory:
                self.context_fit = validate.fit_context(gguf_file, kv_name)
                n_ctx = self.context_fit.n_ctx
            weights, kv = validate.model_memory_needs(gguf_file, n_ctx, kv_type=kv_name)
            validate.check_memory(weights, kv, force=not check_memory, what=os.path.basename(str(path)))
            paged = validate.paging_warning(gguf_file) if check_memory else None
            if paged:  # a mixture of experts larger than memory: runs, its experts paged in from the file
                warnings.warn(f"{os.path.basename(str(path))}: {paged}", stacklevel=2)
        except BaseException:
            gguf_file.close()
            raise
        from edgellm.engine.models import build_model  # kernels: slow to import, loaded with a model
        n_threads = n_threads or default_threads()
        try:
            tokenizer = Tokenizer.from_metadata(gguf_file.metadata)
            if device == "cuda":
                forward_model = build_cuda_model(gguf_file, n_ctx=n_ctx, kv_type=kv_type)
            else:
                forward_model = build_model(gguf_file, n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_name)
            _check_vocabulary(tokenizer, forward_model)
        except BaseException as e:
            tokenizer = forward_model = None  # noqa: F841  (their views into the map must go before it closes)
            _release_failed_load(gguf_file, e)
            raise
        if n_keep is not None:
            forward_model.n_keep = n_keep
        forward_model.context_shift = forward_model.context_shift and bool(context_shift)
        self._assemble(forward_model, tokenizer, gguf_file.metadata, path, gguf_file=gguf_file, n_threads=n_threads)
        self.use_prompt_cache(prompt_cache)
        self.device = device
        self._load_compile_s = 0.0
        self._set_speculation(draft_model, speculative, n_threads=n_threads, kv_type=kv_type,
                              check_memory=check_memory)
        self.timings = Timings(load_s=time.perf_counter() - t0)
        if precompile:
            self.precompile(precompile, compile_progress)

    def _set_speculation(self, draft_model, speculative, **load_kwargs) -> None:
        if draft_model is not None:
            if self.device != "cpu":
                raise SamplingError("speculative decoding runs on the CPU backend only")
            draft = draft_model if isinstance(draft_model, Model) else \
                Model(draft_model, n_ctx=self.n_ctx, **load_kwargs)
            speculative_mod.check_same_vocabulary(self, draft)
            self.draft_model = draft
        if speculative == "auto":
            speculative = "draft" if self.draft_model is not None else None
        self.speculative = speculative_mod.check_mode(speculative, self.draft_model is not None)
        self._spec_costs = {}  # a new drafter: its costs are measured again

    def precompile(self, paths=("prompt",), progress=None) -> float:
        """Compile now the kernels of those warm-up paths (edgellm.generation.kernel_paths.PATHS: "prompt", every
        prompt length and greedy decoding; "sampling"; "batch") that the kernel cache has never had for this model's kind, as
        `edgellm warmup` does, calling progress(edgellm.engine.compile_clock.CompileProgress) as compilations begin
        and once at the end. Returns the seconds it took (0.0 when warm), which timings.compile_s counts from now on."""
        if self.device != "cpu" or not self._fits_warmup():
            return 0.0  # the GPU compiles its own kernels; a context too short for the warm-up compiles on use
        load_s = self.timings.load_s
        seconds = kernel_paths.precompile(self, paths, progress)
        if seconds:
            self._forget_warmup()
        self._load_compile_s += seconds
        self.timings = Timings(load_s=load_s, compile_s=self._load_compile_s)
        return seconds

    def _fits_warmup(self) -> bool:
        # the warm-up must not shift the context on the way
        return len(self.tokenize(kernel_paths.WARMUP_TEXT)) + kernel_paths.WARMUP_TOKENS <= self.n_ctx

    def _forget_warmup(self) -> None:
        """Drop what the warm-up at load left: its cache rows, batch pool and results."""
        self._set_cached([], [])
        self.model.reset()
        release_pool(self)
        self.last_batch = self.last_completion = None

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, revision: str = "main",
                        cache_dir: str | None = None, **kwargs) -> "Model":
        """llama-cpp-python's shape: a GGUF from a Hugging Face Hub repository, pulled into the Hub cache on first
        use. filename: a path in the repository or a glob pattern ("*Q4_K_M.gguf"); None picks as llama.cpp's -hf
        does. kwargs go to Model()."""
        from edgellm.store import hub  # start-up time: only pulls from the Hub need it
        path = hub.pull_pretrained(repo_id, filename, revision=revision, cache_dir=cache_dir,
                                   n_ctx=kwargs.get("n_ctx"), kv_type=kwargs.get("kv_type"),
                                   check_memory=kwargs.get("check_memory", True))
        return cls(path, **kwargs)

    @classmethod
    def from_parts(cls, forward_model, tokenizer, metadata: dict, path: str = "<memory>") -> "Model":
        """A Model around an already-built forward model and tokenizer (tests, custom loaders)."""
        self = cls.__new__(cls)
        self._assemble(forward_model, tokenizer, metadata, path)
        self._load_compile_s = 0.0
        self.timings = Timings()
        return self

    def _assemble(self, forward_model, tokenizer, metadata, path, gguf_file=None, n_threads=None):
        self.path = str(path)
        self.name = os.path.basename(self.path)
        self.file = gguf_file
        self.metadata = metadata
        self.tokenizer = tokenizer
        self.model = forward_model
        self.n_threads = n_threads or getattr(forward_model, "n_threads", 1)
        self.n_vocab = forward_model.n_vocab
        self.n_ctx = forward_model.n_ctx
        self.last_completion: Completion | None = None
        # guards _busy / _busy_thread; reentrant because a stream's finalizer (it releases the model) can run
        # inside a garbage collection triggered while this thread holds it
        self._state = threading.Condition(threading.RLock())
        self._busy = False
        self._busy_thread: int | None = None  # the thread that started or last stepped the call in flight
        # set by cancel(), cleared when a call starts or ends; an Event, not a Model attribute, so the forward
        # model's hook holds no reference back to this Model
        self._cancel_requested = threading.Event()
        forward_model.should_stop = self._cancel_requested.is_set  # DecoderModel checks it between prompt batches
        self._cached_tokens: list[int] = []  # what the KV cache holds, to reuse a shared prompt prefix
        self._cached_kinds: list[int] = []  # how each of those rows was computed (edgellm.engine.prefix)
        self._chat_format = None
        # called with edgellm.engine.compile_clock.CompileProgress while a prompt compiles kernels on first use (before its
        # call yields anything, so a terminal can show it); see also precompile()
        self.compile_progress = None
        self.last_batch: list | None = None
        self.draft_model: Model | None = None  # speculative decoding's drafter, when one was loaded
        self.speculative: str | None = None  # the generating calls' default (load(speculative=...))
        self._spec_costs = {}  # mode -> what speculation measured forwards to cost, kept across calls (ForwardCosts)
        self.prompt_cache = None

    def use_prompt_cache(self, cache) -> None:
        """Keep the KV prefixes of conversations this cache leaves in `cache`: a byte budget, a PromptCache, or None."""
        if cache is not None and not isinstance(cache, PromptCache):
            cache = PromptCache(cache, model_name=self.name, n_vocab=self.n_vocab)
        self.prompt_cache = cache

    def __repr__(self):
        return f"Model({self.name!r}, n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, threads={self.n_threads})"

    # -- tokens --------------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise TypeError(f"tokenize() takes a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids, special: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in self._check_ids(ids)], special=special)

    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise PromptError(f"token ids must be integers, got {arr.dtype} values")
        arr = arr.astype(np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_vocab):
            bad = int(arr[(arr < 0) | (arr >= self.n_vocab)][0])
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})")
        return arr.astype(np.int32)

    # -- logits and the cache ------------------------------------------------------------------------------------
    def logits(self, ids) -> np.ndarray:
        """Teacher-forced logits [len(ids), n_vocab] at every position, from an empty cache."""
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise PromptError("logits() needs at least one token")
        if arr.size > self.n_ctx:
            raise PromptError(f"{arr.size} tokens do not fit in the context of {self.n_ctx}")
        self._acquire("logits")
        try:
            self._set_cached([], [])
            self.model.reset()
            kinds = self._kinds(prefix.fresh_batches(arr.size, self._step(arr.size)))
            try:
                out = self.model.forward(arr, all_logits=True)
            except Cancelled:
                # the batches that ran are whole (and logits() fits the context: nothing shifted)
                n = self.model.n_past
                self._set_cached(arr[:n].tolist(), kinds[:n])
                raise
            check_finite(out, "for the given ids")  # raises with the record empty: no reuse of it
            self._set_cached(arr.tolist(), kinds)
            return out
        finally:
            self._release()

    def _rewind_cache(self, n: int) -> bool:
        """Make the KV cache hold positions [0, n) only (edgellm.engine.prefix.rewind)."""
        return prefix.rewind(getattr(self.model, "cache", None), n)

    def reset(self) -> None:
        """Empty the KV cache: the next prompt is evaluated from its first token (as llama-cpp-python's reset()).
        Without it, a prompt that shares a prefix with what the cache holds reuses the part of it whose rows were
        computed as a fresh run would compute them (edgellm.engine.prefix), so its logits are a fresh run's bit for
        bit."""
        self._acquire("reset")
        try:
            self._set_cached([], [])
            self.model.reset()
        finally:
            self._release()

    def _step(self, n_tokens: int) -> int:
        """The batch length forward() gives a prompt of n_tokens run from an empty cache."""
        step = getattr(self.model, "prompt_step", None)
        return step(None, n_tokens) if step is not None else getattr(self.model, "n_batch", 512)

    def _kinds(self, batches) -> list[int]:
        return prefix.kinds_of(batches, getattr(self.model, "row_kinds", prefix.row_kinds)).tolist()

    def _set_cached(self, tokens: list, kinds: list) -> None:
        self._cached_tokens, self._cached_kinds = tokens, list(kinds)

    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Bring the cache to hold exactly `ids`, reusing the cached rows a fresh run would compute alike
        (edgellm.engine.prefix); return the last logits row, bit for bit a fresh run's."""
        step = self._step(len(ids))
        row_kinds = getattr(self.model, "row_kinds", prefix.row_kinds)
        if len(ids) > self.n_ctx:  # a fresh run shifts the context on the way: run it so
            common, batches = 0, prefix.fresh_batches(len(ids), step)
        else:
            if self.prompt_cache is not None:
                self._swap_prefix(ids, step, row_kinds)
            common, batches = prefix.plan(self._cached_tokens, self._cached_kinds, ids, step, row_kinds)
        kinds = self._cached_kinds[:common]
        self._set_cached([], [])  # until the forward passes below have succeeded
        if common == 0 or not self._rewind_cache(common):
            self.model.reset()
            common, kinds, batches = 0, [], prefix.fresh_batches(len(ids), step)
        kinds = kinds + prefix.kinds_of(batches, row_kinds).tolist()
        try:
            if common == 0:  # forward() splits into the fresh batches itself (and shifts a too long prompt)
                out = self.model.forward(np.asarray(ids, dtype=np.int32), all_logits=False)
            else:
                for b0, b1 in batches:
                    out = self.model.forward(np.asarray(ids[b0:b1], dtype=np.int32), all_logits=False)
        except Cancelled:
            # the batches that ran are whole, so reusable, unless the context shifted on the way
            if not self._shift_log():
                n = self.model.n_past
                self._set_cached(list(ids[:n]), kinds[:n])
            raise
        self._cached_tokens, self._cached_kinds = list(ids), kinds
        self._apply_shifts()
        self.timings.reused_tokens = common
        return out[-1]

    def _scored_prefill(self, ids: list[int], score) -> np.ndarray:
        """_prefill from an empty cache with every row's logits, each batch's rows scored (a PromptScore) as it
        comes, so at most one batch of rows is held; returns the last row. Nothing is re-used: reused rows have no
        logits."""
        if len(ids) > self.n_ctx:
            raise PromptError(f"prompt_logprobs needs the whole prompt in the context: {len(ids)} tokens do not fit "
                              f"in {self.n_ctx}")
        batches = prefix.fresh_batches(len(ids), self._step(len(ids)))
        kinds = self._kinds(batches)
        if self.prompt_cache is not None and self._cached_tokens and not self._shift_log():
            self.prompt_cache.store(self._cached_tokens, self._cached_kinds, self.model.cache)  # before the reset
        self._set_cached([], [])
        self.model.reset()
        try:
            last = score.prefill(self.model, batches)
        except Cancelled:
            n = self.model.n_past  # the batches that ran are whole (nothing shifted: the prompt fits)
            self._set_cached(list(ids[:n]), kinds[:n])
            raise
        self._set_cached(list(ids), kinds)
        self.timings.reused_tokens = 0
        return last

    def _swap_prefix(self, ids, step, row_kinds) -> None:
        """Before the cache moves to another conversation, keep what it holds in the prompt cache; bring in the
        kept prefix of `ids` where it re-uses more than the cache's own."""
        cache = self.model.cache
        here, _ = prefix.plan(self._cached_tokens, self._cached_kinds, ids, step, row_kinds)
        entry = self.prompt_cache.lookup(ids, cache)
        kinds = prefix.narrowed(entry.kinds, self._kind_bits()) if entry is not None else None
        there = prefix.plan(entry.tokens, kinds, ids, step, row_kinds)[0] if entry is not None else 0
        if here < len(self._cached_tokens) and not self._shift_log():
            self.prompt_cache.store(self._cached_tokens, self._cached_kinds, cache)
        if there > here:
            cache.import_state(entry.state)
            self._set_cached(entry.tokens.tolist(), kinds)

    def _kind_bits(self) -> int:
        return getattr(self.model, "row_kind_bits", prefix.ALL_KIND_BITS)

    def _shift_log(self) -> list:
        return getattr(getattr(self.model, "cache", None), "shift_log", None) or []

    def _apply_shifts(self) -> None:
        """Make the record match what the cache holds: each context shift since the last call dropped
        tokens[n_keep : n_keep + n_discard] of what the cache held then, and re-rotated the keys after them,
        which no fresh run computes so."""
        log = self._shift_log()
        tokens, kinds = self._cached_tokens, self._cached_kinds
        for n_keep, n_discard in log:
            del tokens[n_keep:n_keep + n_discard]
            del kinds[n_keep:n_keep + n_discard]
            kinds[n_keep:] = [prefix.TAINTED] * (len(kinds) - n_keep)
        log.clear()

    # -- session state -------------------------------------------------------------------------------------------
    def save_state(self):
        """A snapshot of the KV cache and the tokens it holds (edgellm.generation.state.ModelState; .save(path)
        writes it)."""
        self._acquire("save_state")
        try:
            return ModelState(self.name, self.n_ctx, list(self._cached_tokens), self.model.cache.export_state(),
                              list(self._cached_kinds))
        finally:
            self._release()

    def load_state(self, state) -> None:
        """Restore a snapshot from save_state() (or ModelState.load(path)) of a model of the same file, n_ctx and
        kv_type: the next generation continues from exactly that cache."""
        if not isinstance(state, ModelState):
            raise TypeError(f"load_state() takes what save_state() returned, got {type(state).__name__}")
        if state.model_name != self.name:
            raise ModelError(f"the state was saved from {state.model_name!r}, not {self.name!r}")
        if state.n_ctx != self.n_ctx:
            raise ModelError(f"the state was saved with n_ctx {state.n_ctx}, this model has {self.n_ctx}")
        tokens = list(state.tokens)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab for t in tokens):
            raise ModelError(f"the state's tokens must be ids in [0, {self.n_vocab})")
        self._acquire("load_state")
        try:
            self.model.cache.import_state(state.cache)  # refuses a misfit before changing anything
            kinds = prefix.narrowed(state.row_kinds, self._kind_bits()) \
                if state.row_kinds is not None and len(state.row_kinds) == len(tokens) \
                else [prefix.TAINTED] * len(tokens)  # unknown: continued from, never reused
            self._set_cached(tokens, kinds)
        finally:
            self._release()

    # -- one call at a time --------------------------------------------------------------------------------------
    def _acquire(self, what: str) -> None:
        me = threading.get_ident()
        with self._state:
            while self._busy:
                if self._busy_thread == me:
                    raise ModelBusyError(f"{what}() was called while another generation on this model is "
                                         "unfinished; exhaust or close() the earlier stream first")
                self._state.wait()
            self._busy, self._busy_thread = True, me
            self._cancel_requested.clear()  # a cancel() aimed at an earlier call must not end this one

    def _release(self) -> None:
        with self._state:
            self._busy, self._busy_thread = False, None
            self._cancel_requested.clear()
            self._state.notify_all()

    @contextlib.contextmanager
    def exclusive(self, what: str):
        """Hold the model for one call, as every generating call does: waits while another call holds it
        (ModelBusyError where this thread's own unfinished stream holds it). `what` names the call in that error."""
        self._acquire(what)
        try:
            yield self
        finally:
            self._release()

    @property
    def cancel_requested(self) -> bool:
        """Whether cancel() was called during the call in flight: a decode loop stops at its next step."""
        return self._cancel_requested.is_set()

    def cancel(self) -> bool:
        """End the call in flight, from any thread: at its next prompt batch or decode step it returns what it has
        (stop_reason "cancelled"; logits() raises Cancelled) and the model stays usable. Returns whether a call
        was in flight; with none, nothing happens (a later call is not affected)."""
        with self._state:
            if self._busy:
                self._cancel_requested.set()
            return self._busy

    # -- the decode loop -----------------------------------------------------------------------------------------
    def prompt_ids(self, prompt, add_special: bool = True) -> list[int]:
        """A prompt (text, or token ids) as token ids, checked: not empty, ids in the vocabulary, and a prompt
        longer than the context only where the context shifts (with a ContextShiftWarning)."""
        if isinstance(prompt, bytes):
            prompt = prompt.decode("utf-8")
        if isinstance(prompt, str):
            if prompt == "":
                raise PromptError("the prompt is empty: give some text or token ids")
            ids = self.tokenize(prompt, add_special=add_special, parse_special=True)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = self._check_ids(prompt).tolist()
        else:
            raise TypeError(f"the prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise PromptError("the prompt is empty: give some text or token ids")
        if len(ids) >= self.n_ctx:
            if not getattr(self.model, "context_shift", False):
                raise PromptError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                                  "(one position is needed for the first generated token)")
            warnings.warn(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx}: it goes through "
                          f"the cache in chunks and only its first {self.model.n_keep} and most recent tokens stay "
                          "in view", ContextShiftWarning, stacklevel=3)
        return ids

    def decode_events(self, ids: list[int], opts: GenerationOptions):
        """Generate after prompt ids: a generator of (text piece, TokenInfo or None) per step, then the Completion.

        Checks what it can before returning; the generator holds the model from its first step to its end, so a
        consumer that stops early must close() it (or drop it)."""
        mode = self.speculative if opts.speculative is MODEL_DEFAULT else opts.speculative
        speculative_mod.check_mode(mode, self.draft_model is not None)  # refused before anything runs
        return self._locked_decode(ids, opts, logit_bias_arrays(opts, self.n_vocab))

    def _locked_decode(self, ids, opts, bias):
        self._acquire("generate")
        try:
            for event in self._decode(ids, opts, bias):
                yield event
                with self._state:  # whoever steps a stream owns it: that thread must not wait for it
                    self._busy_thread = threading.get_ident()
        except GeneratorExit:
            raise  # the consumer stopped: the cache bookkeeping is consistent at every yield
        except BaseException:
            self._set_cached([], [])  # an error or Ctrl-C mid-step: trust nothing the cache holds
            raise
        finally:
            self._release()

    def _decode(self, ids, opts, bias):
        budget = max_new_tokens(opts.max_tokens, self.n_ctx, len(ids), getattr(self.model, "context_shift", False))
        seq = SequenceState(self, ids, opts, budget, bias)
        t = self.timings = Timings(load_s=self.timings.load_s, prompt_tokens=len(ids))
        t.compile_s = self._load_compile_s
        t0, c0 = time.perf_counter(), compile_seconds()  # kernels compiled on first use are timed apart
        decode_kind = self._kinds([(0, 1)])[0]
        spec = None
        score = None if opts.prompt_logprobs is None else PromptScore(self.tokenizer, ids, opts.prompt_logprobs)
        if not seq.done or score is not None:  # (a prompt scored with max_tokens 0 is prefilled all the same)
            try:
                with reporting_compiles(self.compile_progress):
                    logits = self._prefill(ids) if score is None else self._scored_prefill(ids, score)
            except Cancelled:
                logits = None
            c1 = compile_seconds()
            t.prompt_s = time.perf_counter() - t0 - (c1 - c0)
            t1 = time.perf_counter()
            if logits is not None:
                spec = self._speculator(opts, seq)
                if score is not None:
                    seq.prompt_info = score.infos
                    yield PromptScored(score.infos)
            while not seq.done:
                if logits is None or self._cancel_requested.is_set():
                    seq.stop_reason = "cancelled"
                    break
                scanned = check_finite(logits, f"after {len(seq.history)} tokens")
                event = seq.step(logits, scanned=scanned)
                if event is None:
                    break
                yield event
                if seq.done:
                    break
                token = seq.generated[-1]
                draft = spec.draft(seq.history, seq.max_tokens - len(seq.generated)) if spec is not None else None
                ended = all_accepted = False
                while draft is not None:
                    # the target's row after each drafted token, in order, while the drafts are accepted
                    accepted, logits = 0, draft.rows[-1]
                    for row, choice in zip(draft.rows, draft.choices):
                        scanned = check_finite(row, f"after {len(seq.history)} tokens")
                        event = seq.step(row, choice, scanned)
                        if event is None:
                            break
                        yield event
                        if seq.generated[-1] != choice[0]:
                            break
                        accepted += 1
                        if seq.done:
                            break
                    kept = spec.settle(draft, accepted)
                    self._cached_tokens += kept
                    self._cached_kinds += [decode_kind] * len(kept)
                    ended = event is None or seq.done
                    all_accepted = accepted == len(draft.choices)
                    if ended or all_accepted or self._cancel_requested.is_set():
                        break
                    # the target's own token where the draft was rejected is not in the cache yet: it leads the
                    # next draft's rows, or a plain step below when there is none
                    token = seq.generated[-1]
                    draft = spec.draft(seq.history, seq.max_tokens - len(seq.generated))
                if ended:
                    break
                if all_accepted:
                    continue  # every draft accepted: the last row gives the next token
                try:
                    ts = time.perf_counter()
                    logits = self.model.forward(np.array([token], dtype=np.int32))[-1]
                    if spec is not None:
                        spec.timed_step(time.perf_counter() - ts)
                except Cancelled:
                    logits = None  # the token was generated but not fed: the cache does not hold it
                    continue
                self._cached_tokens.append(token)
                self._cached_kinds.append(decode_kind)  # (after a tainted row it is never reused: see prefix.plan)
                if self._shift_log():
                    self._apply_shifts()
            t.generated_tokens = len(seq.generated)
            c2 = compile_seconds()
            t.generate_s = time.perf_counter() - t1 - (c2 - c1)
            if spec is not None:
                t.draft_tokens, t.accepted_tokens = spec.drafted, spec.accepted
                cost_store.save(spec.length.costs, self._spec_cost_path(spec.mode))
            t.compile_s += c2 - c0
            t.sample_s = seq.sample_s
            t.mask_s = seq.constraint.mask_s if seq.constraint is not None else 0.0
        piece, completion = seq.finish()
        if spec is not None:
            completion.speculative = spec.mode
            completion.draft_tokens, completion.accepted_tokens = spec.drafted, spec.accepted
        if piece:
            yield piece, None
        self.last_completion = completion
        yield completion

    def _speculator(self, opts, seq):
        """The speculative decoding this call asked for (or the model's default), started for its sequence;
        None when off."""
        mode = self.speculative if opts.speculative is MODEL_DEFAULT else opts.speculative
        mode = speculative_mod.check_mode(mode, self.draft_model is not None)
        if mode is None or opts.draft_max == 0:
            return None
        if not hasattr(self.model, "forward_verify"):
            raise SamplingError(f"speculative decoding needs the CPU backend; {type(self.model).__name__} has no "
                                "verification pass")
        if mode == "lookup":
            drafter = speculative_mod.PromptLookup()
        else:
            sampler = None if opts.sampling.greedy else Sampler(
                opts.sampling, seed=None if opts.seed is None else opts.seed + 1)  # its own stream of draws
            drafter = speculative_mod.DraftModel(self.draft_model, sampler)
            drafter.start(seq.history)
        costs = self._spec_costs.get(mode)  # kept across calls, and on disk across processes
        if costs is None:
            costs = self._spec_costs[mode] = speculative_mod.ForwardCosts()
            cost_store.load(costs, self._spec_cost_path(mode))
        costs.start_generation()
        return speculative_mod.Speculator(mode, self.model, drafter, opts.draft_max, opts.draft_min, costs)

    def _spec_cost_path(self, mode: str, server: bool = False):
        """Where speculation's forward costs for this model, drafter and set-up are kept (cost_store); a server's
        (edgellm.generation.scheduler) apart from the API's, as its forwards batch several sequences."""
        draft = self.draft_model.path if mode == "draft" and self.draft_model is not None else None
        return cost_store.table_path(self.path, f"{mode}-server" if server else mode, draft, self.n_threads,
                                     getattr(self.model, "kv_type", ""))

    # -- generate / complete / stream ----------------------------------------------------------------------------
    NATIVE_DEFAULTS = {"temperature": 0.0}

    def _native(self, caller: str, prompt, max_tokens, options: dict):
        opts = parse_options(caller, {**options, "max_tokens": max_tokens}, self.NATIVE_DEFAULTS)
        return self.decode_events(self.prompt_ids(prompt), opts)

    def generate(self, prompt, max_tokens: int | None = 128, **options) -> str:
        """Text generated after `prompt` (text or token ids). Greedy unless temperature > 0; ends at an
        end-of-generation token (unless ignore_eos), a stop string, or max_tokens (None: until the context is full).

        Options: temperature, top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty, frequency_penalty,
        repeat_last_n, seed, stop, ignore_eos, logprobs, logit_bias, logits_processor, stopping_criteria."""
        return self.complete(prompt, max_tokens, **options).text

    def complete(self, prompt, max_tokens: int | None = 128, **options) -> Completion:
        """Like generate, returning the Completion: text, token ids, finish/stop reason, per-token logprobs."""
        for event in self._native("complete", prompt, max_tokens, options):
            if isinstance(event, Completion):
                return event
        raise AssertionError("the decode loop ended without a Completion")

    def stream(self, prompt, max_tokens: int | None = 128, **options):
        """Yield text pieces as soon as they are whole UTF-8 characters and cannot be part of a stop string.

        Takes generate's options. The Completion is the generator's return value and `model.last_completion`."""
        events = self._native("stream", prompt, max_tokens, options)  # validates now, not at the first next()
        return self._pieces(events)

    @staticmethod
    def _pieces(events):
        with _closing(events):
            for event in events:
                if isinstance(event, Completion):
                    return event
                if not isinstance(event, PromptScored) and event[0]:
                    yield event[0]

    # -- batches -------------------------------------------------------------------------------------------------
    def stream_batch(self, prompts, max_tokens: int | None = 128, n_parallel: int | None = None,
                     seq_ctx: int | None = None, **options):
        """Generate for many prompts at once, yielding (prompt index, text piece) as pieces come. Up to n_parallel
        sequences (default: all, at most n_batch) decode together, each decode step reading the weights once for
        all; when one finishes, the next queued prompt takes its slot. Each sequence has its own KV cache of
        seq_ctx positions (default: enough for its prompt and max_tokens) and its own sampler (same options and
        seed for all); greedy, each gives exactly the tokens it gives alone. The Completions, in prompt order,
        are the generator's return value and `model.last_batch`. Takes generate's options."""
        return run_batch(self, *prepare(self, prompts, max_tokens, n_parallel, seq_ctx, options))

    def complete_batch(self, prompts, max_tokens: int | None = 128, n_parallel: int | None = None,
                       seq_ctx: int | None = None, **options) -> list:
        """stream_batch run to its end: the Completions, in prompt order."""
        events = self.stream_batch(prompts, max_tokens, n_parallel, seq_ctx, **options)
        with _closing(events):
            while True:
                try:
                    next(events)
                except StopIteration as stop:
                    return stop.value

    def generate_batch(self, prompts, max_tokens: int | None = 128, n_parallel: int | None = None,
                       seq_ctx: int | None = None, **options) -> list:
        """The generated texts for many prompts, decoded together (see stream_batch)."""
        return [c.text for c in self.complete_batch(prompts, max_tokens, n_parallel, seq_ctx, **options)]

    # -- chat ----------------------------------------------------------------------------------------------------
    def chat_format(self):
        """The formatter chat() uses: the GGUF's Jinja2 template, or a built-in format when the file has none."""
        if self._chat_format is None:
            tok = self.tokenizer
            bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
            self._chat_format = chat_template_from_metadata(self.metadata, bos_token=bos, eos_token=eos)
        return self._chat_format

    def chat_prompt_ids(self, messages, add_generation_prompt: bool = True, **template_vars) -> list[int]:
        """The token ids of a conversation rendered with the model's chat format; template_vars (e.g. tools,
        enable_thinking) go to the template as variables."""
        fmt = self.chat_format()
        text = fmt.render(messages, add_generation_prompt=add_generation_prompt, **template_vars)
        # a GGUF template writes BOS itself when the model wants one (llama-cpp-python: add_bos=False);
        # the built-in formats leave it to the tokenizer, as llama.cpp does
        return self.prompt_ids(text, add_special=getattr(fmt, "name", "") != "gguf")

    def chat(self, messages, max_tokens: int | None = 512, stream: bool = False, **options):
        """The assistant's reply to an OpenAI-style message list (str), or its pieces when stream=True.

        Takes generate's options; greedy unless temperature > 0."""
        opts = parse_options("chat", {**options, "max_tokens": max_tokens}, self.NATIVE_DEFAULTS)
        events = self.decode_events(self.chat_prompt_ids(messages), opts)
        if stream:
            return self._pieces(events)
        for event in events:
            if isinstance(event, Completion):
                return event.text
        raise AssertionError("the decode loop ended without a Completion")

    # -- llama-cpp-python-shaped calls ---------------------------------------------------------------------------
    def create_completion(self, prompt, **kwargs):
        """llama_cpp.Llama.create_completion: a CreateCompletionResponse dict, or an iterator of chunks."""
        from edgellm.compat import llama_compat  # (with tool calls, constrained decoding: not needed to load)
        return llama_compat.create_completion(self, prompt, **kwargs)

    __call__ = create_completion

    def create_chat_completion(self, messages, **kwargs):
        """llama_cpp.Llama.create_chat_completion: a CreateChatCompletionResponse dict, or an iterator of chunks."""
        from edgellm.compat import llama_compat  # (as in create_completion)
        return llama_compat.create_chat_completion(self, messages, **kwargs)

    # -- embeddings ----------------------------------------------------------------------------------------------
    def _embeddings(self, inputs, pooling: str, normalize: bool):
        """(a vector per input, whether one input was given, the inputs' token count)."""
        from edgellm.generation import embeddings  # start-up time: loaded by the first embedding call
        ids, single = embeddings.input_ids(self, inputs)
        self._acquire("embed")
        try:
            vectors = embeddings.embed_ids(self.model, ids, pooling, normalize)
        finally:
            self._release()
        return vectors, single, sum(len(i) for i in ids)

    def embed(self, input, pooling: str = "mean", normalize: bool = True):
        """The input's embedding: a text's (or token list's) vector as a list of floats, or a list of them for a
        list of inputs. Each input runs from an empty cache of its own (the model's cache, and a conversation in
        it, stay as they were); its tokens' output-normed hidden states are pooled ("mean", "last", or "none": a
        vector per token) and L2-normalised unless normalize=False (edgellm/generation/embeddings.py)."""
        vectors, single, _ = self._embeddings(input, pooling, normalize)
        out = [v.tolist() for v in vectors]
        return out[0] if single else out

    def create_embedding(self, input, model: str | None = None, pooling: str = "mean", normalize: bool = True):
        """llama_cpp.Llama.create_embedding: OpenAI's embedding response dict, a vector per input."""
        from edgellm.generation.embeddings import embedding_response  # (as in _embeddings)
        vectors, _, n_tokens = self._embeddings(input, pooling, normalize)
        return embedding_response(vectors, model or self.path, n_tokens)


class _closing:
    """Close a generator when the block ends, even if its consumer abandoned it half-way."""

    def __init__(self, gen):
        self.gen = gen

    def __enter__(self):
        return self.gen

    def __exit__(self, *exc):
        self.gen.close()
        return False


def _check_vocabulary(tokenizer, forward_model):
    # every id the tokenizer can emit must have an embedding row, or generation fails at the first such token
    if tokenizer.n_vocab > forward_model.n_vocab:
        raise ModelError(f"the tokenizer has {tokenizer.n_vocab} tokens but token_embd.weight has only "
                         f"{forward_model.n_vocab} rows: ids {forward_model.n_vocab}..{tokenizer.n_vocab - 1} "
                         "could be produced but not embedded")


def _release_failed_load(gguf_file, error):
    """Unmap a file whose model could not be built. The traceback's frames hold views into the map (token
    tables, tensors), which would keep it mapped for as long as the exception lives; their locals are dropped."""
    traceback.clear_frames(error.__traceback__)
    gguf_file.metadata = {}
    gguf_file.close()


def load(model=None, n_threads: int | None = None, n_ctx: int | None = None, **kwargs) -> Model:
    """Load a model by catalog name (pulled on first use) or path to a .gguf file."""
    return Model(model, n_threads=n_threads, n_ctx=n_ctx, **kwargs)


__all__ = ["Model", "load", "Completion", "TokenInfo", "Timings", "PromptError", "ModelBusyError", "EdgeLLMError",
           "SamplingError", "NumericalError", "Cancelled"]
