"""Constrained decoding through llguidance: JSON (any object or a JSON Schema), GBNF/Lark grammars, regexes and a
choice among strings.

Sections: `ConstraintSpec`, a checked grammar built from the user's arguments (before any model work, so a bad
schema or grammar fails with GrammarError first); `LlamaGrammar`, llama-cpp-python's grammar object shape; the
llguidance tokenizer built once per model from the GGUF vocabulary (every token's bytes; control tokens marked
with a 0xFF prefix so no text can spell them, as llguidance's llama.cpp bridge does); `SequenceConstraint`, one
sequence's matcher: a token mask applied before the sampler chain, advanced on each sampled token; the two Numba
kernels that read llguidance's bitmask (apply_bitmask, best_allowed), each beside its numpy reference.

The mask sets disallowed tokens to -inf before penalties, top-k/p, min-p, temperature and the draw, so every
sampler and logit_bias keep working on the tokens the grammar allows. When the grammar is complete and nothing
more can follow, generation ends with finish_reason "stop".
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numba import njit

from edgellm.errors import GrammarError
from edgellm.tokenizer.vocab import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED

# JSON as Python's json.dumps writes it: one space after ',' and ':', no free whitespace, so a small model
# cannot wander into endless newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Limits for what a schema leaves unbounded: a small model decoding greedily can repeat a digit, a word or an item
# until max_tokens, and a reply cut there does not parse. Each applies only where the schema is silent (its own
# maxLength, minimum/maximum, multipleOf or maxItems win); set one to None to lift it for every schema.
JSON_BOUNDS = {
    "max_string_length": 128,   # characters of a string with no maxLength, enum or const
    "max_integer_digits": 15,   # an integer or number lies within +-(10**15 - 1), as llama.cpp's JSON grammar allows
    "max_fraction_digits": 6,   # a number is a multiple of 1e-6 (no exponent), so "1.000000..." ends
    "max_items": 32,            # items of an array with no maxItems
}

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "additionalItems", "contains", "if", "then", "else",  # one or a list
               "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "prefixItems")


def _types(schema: dict) -> set:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def bounded_schema(schema, bounds: dict | None = None):
    """The schema with JSON_BOUNDS added wherever a string, number or array it explicitly types is unbounded.
    Subschemas under "not" are left alone (a bound there would widen, not narrow)."""
    bounds = JSON_BOUNDS if bounds is None else bounds
    if isinstance(schema, list):
        return [bounded_schema(s, bounds) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(sub, bounds) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = bounded_schema(out[key], bounds)
    if "enum" in out or "const" in out:
        return out
    types = _types(out)
    if "string" in types and "maxLength" not in out and bounds.get("max_string_length") is not None:
        out["maxLength"] = max(bounds["max_string_length"], out.get("minLength", 0))
    if types & {"integer", "number"} and bounds.get("max_integer_digits") is not None:
        limit = 10 ** bounds["max_integer_digits"] - 1
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -limit
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = limit
    if "number" in types and "multipleOf" not in out and bounds.get("max_fraction_digits") is not None:
        out["multipleOf"] = 10.0 ** -bounds["max_fraction_digits"]
    if "array" in types and "maxItems" not in out and bounds.get("max_items") is not None:
        out["maxItems"] = max(bounds["max_items"], out.get("minItems", 0))
    return out


def bounded_or_given(schema: dict) -> dict:
    """bounded_schema(schema) where the engine can enforce it, else the schema as given (for grammars that embed
    a schema, e.g. tool calls)."""
    bounded = bounded_schema(schema)
    try:
        ConstraintSpec._compiled(bounded, "", "schema")
    except GrammarError:
        return schema
    return bounded


def _llg():
    try:
        import llguidance  # a slow import (a Rust extension): loaded with the first grammar
    except ImportError as e:  # a core dependency; only a broken install gets here
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from e
    return llguidance


# ---------------------------------------------------------------------------------------------------------------
# What to enforce
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConstraintSpec:
    """A validated llguidance grammar; `kind` and `source` say what the user gave, for messages."""

    kind: str  # "json_schema", "gbnf", "lark", "regex", "choice"
    source: str
    grammar: str  # llguidance's serialized grammar
    closable: bool = False  # JSON: near max_tokens, decoding may take the closing path (SequenceConstraint)

    @classmethod
    def json_schema(cls, schema, what: str = "schema", bounds: dict | None = None) -> "ConstraintSpec":
        """bounds: JSON_BOUNDS (None) or others for what the schema leaves unbounded; {} adds none."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{what} is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(f"{what} must be a JSON Schema object, got {type(schema).__name__}")
        try:  # the schema as given when the default bounds conflict with it (e.g. a range finer than 1e-6)
            return cls._compiled(bounded_schema(schema, bounds), json.dumps(schema), what)
        except GrammarError:
            return cls._compiled(schema, json.dumps(schema), what)

    @classmethod
    def _compiled(cls, schema: dict, source: str, what: str) -> "ConstraintSpec":
        try:
            grammar = _llg().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{what} cannot be compiled: {e}") from None
        return cls._checked("json_schema", source, grammar, what)

    @classmethod
    def gbnf(cls, text: str, what: str = "grammar") -> "ConstraintSpec":
        """A llama.cpp GBNF grammar (its start rule is `root`); llguidance also reads Lark syntax here."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"{what} must be a non-empty GBNF grammar string")
        llg = _llg()
        from llguidance.gbnf_to_lark import any_to_lark  # loaded with the first grammar, as llguidance is
        try:
            lark = any_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions for syntax errors
            raise GrammarError(f"{what} is not a valid GBNF grammar: {e}") from None
        # the converter writes GBNF's \U0010FFFF as \U10FFFF, which the regex engine refuses; \u{10FFFF} it reads
        lark = re.sub(r"(?<!\\)\\U([0-9A-Fa-f]{1,8})", lambda m: "\\u{%X}" % int(m.group(1), 16), lark)
        grammar = llg.LLMatcher.grammar_from_lark(lark)
        return cls._checked("gbnf", text, grammar, what)

    @classmethod
    def regex(cls, pattern: str, what: str = "regex") -> "ConstraintSpec":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"{what} must be a non-empty regular expression string")
        return cls._checked("regex", pattern, _llg().LLMatcher.grammar_from_regex(pattern), what)

    @classmethod
    def choice(cls, options, what: str = "choice") -> "ConstraintSpec":
        if isinstance(options, (str, bytes)) or not isinstance(options, (list, tuple)) or not options:
            raise GrammarError(f"{what} must be a non-empty list of strings")
        for i, option in enumerate(options):
            if not isinstance(option, str) or not option:
                raise GrammarError(f"{what}[{i}] must be a non-empty string, got {option!r}")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return cls._checked("choice", json.dumps(list(options)), _llg().LLMatcher.grammar_from_lark(lark), what)

    @classmethod
    def lark(cls, text: str, what: str = "grammar", closable: bool = False) -> "ConstraintSpec":
        """A grammar in llguidance's Lark syntax (e.g. one built from tool schemas; closable: its output is JSON
        apart from literal markers)."""
        return cls._checked("lark", text, _llg().LLMatcher.grammar_from_lark(text), what, closable)

    @classmethod
    def _checked(cls, kind, source, grammar, what, closable=None) -> "ConstraintSpec":
        error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
        if error:
            raise GrammarError(f"{what} cannot be enforced: {messages[0] if messages else 'invalid grammar'}")
        return cls(kind, source, grammar, kind == "json_schema" if closable is None else closable)


class LlamaGrammar:
    """llama-cpp-python's LlamaGrammar: from_string(gbnf), from_file(path), from_json_schema(json text)."""

    def __init__(self, *, _grammar: str, _spec: ConstraintSpec | None = None):
        self._grammar = _grammar
        self._spec = _spec or ConstraintSpec.gbnf(_grammar)

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file, verbose: bool = True) -> "LlamaGrammar":
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise GrammarError(f"cannot read the grammar file {str(file)!r}: {e.strerror}") from None
        return cls(_grammar=text)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        spec = ConstraintSpec.json_schema(json_schema)
        return cls(_grammar=spec.source, _spec=spec)

    def __repr__(self):
        return f"LlamaGrammar({self._spec.kind}, {len(self._grammar)} chars)"


def closed_objects(schema):
    """The schema with additionalProperties false wherever an object lists properties and says nothing else:
    OpenAI's strict mode, which keeps a small model from inventing keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def response_format_spec(value) -> ConstraintSpec | None:
    """OpenAI's and llama-cpp-python's response_format: text, json_object (optionally with "schema"), json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarError("response_format must be an object with a 'type': 'text', 'json_object' or 'json_schema'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        return ConstraintSpec.json_schema({"type": "object"} if schema is None else schema,
                                          "response_format.schema")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise GrammarError("response_format.json_schema must be an object with 'name' and 'schema'")
        schema = body.get("schema")
        if body.get("strict") and isinstance(schema, dict):
            schema = closed_objects(schema)
        return ConstraintSpec.json_schema({"type": "object"} if schema is None else schema,
                                          "response_format.json_schema.schema")
    raise GrammarError(f"response_format type {kind!r} is not supported (accepted: 'text', 'json_object', "
                       "'json_schema')")


def constraint_from_options(values: dict) -> ConstraintSpec | None:
    """The one constraint named among grammar=, response_format=, json_schema=, regex=, choice= (None: none)."""
    given = [n for n in ("grammar", "response_format", "json_schema", "regex", "choice") if values.get(n) is not None]
    if "response_format" in given and response_format_spec(values["response_format"]) is None:
        given.remove("response_format")  # {"type": "text"} constrains nothing
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"give at most one of grammar, response_format, json_schema, regex, choice (got "
                           f"{', '.join(given)})")
    name = given[0]
    value = values[name]
    if name == "grammar":
        if isinstance(value, ConstraintSpec):
            return value
        if isinstance(value, LlamaGrammar):
            return value._spec
        if hasattr(value, "_grammar") and isinstance(value._grammar, str):  # llama_cpp.LlamaGrammar itself
            return ConstraintSpec.gbnf(value._grammar)
        if isinstance(value, str):
            return ConstraintSpec.gbnf(value)
        raise GrammarError(f"grammar must be a GBNF string or a LlamaGrammar, got {type(value).__name__}")
    if name == "response_format":
        return response_format_spec(value)
    if name == "json_schema":
        return ConstraintSpec.json_schema(value, "json_schema")
    if name == "regex":
        return ConstraintSpec.regex(value)
    return ConstraintSpec.choice(value)


# ---------------------------------------------------------------------------------------------------------------
# The llguidance tokenizer of a model
# ---------------------------------------------------------------------------------------------------------------

class _VocabWrapper:
    """What llguidance's LLTokenizer reads from a Python tokenizer: token bytes, special ids, a tokenize call."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        vocab = tokenizer.vocab
        tokens, special = [], []
        for i in range(tokenizer.n_vocab):
            attr = int(vocab.attrs[i])
            if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                piece = b"\xff" + vocab.tokens[i].encode("utf-8")
                special.append(i)
            else:
                piece = tokenizer.token_to_bytes(i)
                if attr & ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"):
                    piece = b"\xff" + piece  # e.g. <tool_call>: written by the model as one token, not spelled
                    special.append(i)
            tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


_TOKENIZER_LOCK = threading.Lock()
_LLG_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> its llguidance tokenizer


def llg_tokenizer(tokenizer):
    """The llguidance tokenizer of an edgellm Tokenizer, built on first use (it takes a
    noticeable fraction of a second) and kept on it; every end-of-generation token ends a grammar."""
    with _TOKENIZER_LOCK:
        cached = _LLG_TOKENIZERS.get(tokenizer)
        if cached is None:
            eog = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
            cached = _llg().LLTokenizer(_VocabWrapper(tokenizer), n_vocab=tokenizer.n_vocab, eos_token=eog)
            _LLG_TOKENIZERS[tokenizer] = cached
        return cached


CLOSING_HORIZON = 128  # tokens left from which the closing path is measured (replies that end sooner pay nothing)
CLOSING_WATCH = 24  # tokens of slack under which every sampled token is vetted against the closing path
# Tokenizer -> (priority in string, outside, and the token ids in each priority order)
_CLOSING_PRIORITY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def closing_priority(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    return _closing_ranks(tokenizer)[:2]


def _closing_ranks(tokenizer) -> tuple:
    """How the closing path ranks the tokens a grammar allows, inside a JSON string and outside one. Inside: a
    token that starts with the closing quote. Outside: one that starts with '}' or ']', then one that starts a
    string (the shortest value, or a required key). Then the longest, for fixed patterns. End-of-generation
    tokens never: the path ends where the grammar accepts."""
    with _TOKENIZER_LOCK:
        cached = _CLOSING_PRIORITY.get(tokenizer)
        if cached is None:
            n = tokenizer.n_vocab
            first = np.zeros(n, dtype=np.uint8)
            length = np.zeros(n, dtype=np.float64)
            for i in range(n):
                piece = tokenizer.token_to_bytes(i)
                if piece:
                    first[i], length[i] = piece[0], len(piece)
            quote, closer = first == ord('"'), (first == ord("}")) | (first == ord("]"))
            # among equal lengths, not a leading zero: "0000-00-00" fits a date pattern but is no date
            length += 0.5 * (first != ord("0"))
            inside = np.where(quote, 1e6, 0.0) + length
            outside = np.where(closer, 1e6, np.where(quote, 1e3, 0.0)) + length
            eog = sorted(tokenizer.eog_ids)
            inside[eog] = outside[eog] = -1.0
            cached = _CLOSING_PRIORITY[tokenizer] = (  # (a stable sort keeps equal priorities in id order)
                inside, outside, *(np.argsort(-p, kind="stable").astype(np.int32) for p in (inside, outside)))
        return cached


def _json_string_state(piece: bytes, in_string: bool, escaped: bool) -> tuple[bool, bool]:
    """Whether JSON text is inside a string (and after a backslash) once piece follows."""
    for c in piece:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
    return in_string, escaped


# ---------------------------------------------------------------------------------------------------------------
# One sequence's matcher
# ---------------------------------------------------------------------------------------------------------------

_LANES = np.arange(32, dtype=np.int64)


def allowed_ids(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids set in an llguidance bitmask (int32 words, bit i of word w is token 32*w + i)."""
    nz = np.flatnonzero(words)
    bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(nz.size, 32).view(bool)
    ids = (nz[:, None] * 32 + _LANES)[bits]
    return ids[ids < n_vocab]


def masked_scores(words: np.ndarray, scores: np.ndarray) -> np.ndarray | None:
    """numpy reference of apply_bitmask: scores with every token the bitmask leaves out at -inf (None: none left)."""
    ids = allowed_ids(words, scores.shape[-1])
    if ids.size == 0:
        return None
    out = np.full(scores.shape, -np.inf, dtype=np.float32)
    out[ids] = scores[ids]
    return out


@njit(cache=True, nogil=True)
def apply_bitmask(words, scores, out):
    """out[i] = scores[i] where bit i of the bitmask is set, else -inf, in one pass (a 262,144-token row costs
    about as much as copying it); returns how many tokens are allowed."""
    n = scores.shape[0]
    allowed = 0
    for w in range(words.shape[0]):
        word = np.uint32(words[w])
        base = w * 32
        top = min(base + 32, n)
        if word == 0:  # whole words out or in (most words of a mask), as straight copies
            out[base:top] = -np.inf
        elif word == np.uint32(0xFFFFFFFF):
            out[base:top] = scores[base:top]
            allowed += top - base
        else:
            for i in range(base, top):
                bit = (word >> np.uint32(i - base)) & np.uint32(1)
                out[i] = scores[i] if bit else -np.inf
                allowed += bit
    return allowed


def best_allowed_ref(words: np.ndarray, priority: np.ndarray) -> int:
    """numpy reference of best_allowed: the allowed token of highest priority, the lowest id among equals."""
    ids = allowed_ids(words, priority.size)
    return int(ids[np.argmax(priority[ids])]) if ids.size else -1


@njit(cache=True, nogil=True)
def best_allowed(words, priority, order):
    """The allowed token of highest priority, the lowest id among equals (-1: none). order lists the tokens by
    priority, highest first, ties by id: a dense mask (inside a string) finds its token in the first few; a
    sparse one (after a key, in a number) is read word by word instead."""
    n_words = words.shape[0]
    nonzero = 0
    for w in range(n_words):
        if words[w] != 0:
            nonzero += 1
    if nonzero * 8 >= n_words:
        for j in range(order.shape[0]):
            t = order[j]
            if (np.uint32(words[t >> 5]) >> np.uint32(t & 31)) & np.uint32(1):
                return t
        return -1
    best, best_p = -1, -np.inf
    for w in range(n_words):
        word = np.uint32(words[w])
        if word == 0:
            continue
        for b in range(32):
            t = w * 32 + b
            if t < priority.shape[0] and (word >> np.uint32(b)) & np.uint32(1) and (best < 0 or priority[t] > best_p):
                best, best_p = t, priority[t]
    return best


class SequenceConstraint:
    """The grammar state of one sequence: mask(scores) before each draw, advance(token) after it."""

    def __init__(self, spec: ConstraintSpec, tokenizer, n_vocab: int):
        llg = _llg()
        self.spec = spec
        self.n_vocab = n_vocab
        self.tokenizer = tokenizer
        self.closing = False  # following the closing path: the tokens left only just suffice to complete
        self._next_check = None  # tokens left at which to measure the closing path again
        self._string_state = (False, False)  # inside a JSON string, after a backslash
        self._vetting = False  # the slack is small: every sampled token is checked (vet)
        self.matcher = llg.LLMatcher(llg_tokenizer(tokenizer), spec.grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the {spec.kind} cannot be enforced: {self.matcher.get_error()}")
        self._words = np.empty((n_vocab + 31) // 32, dtype=np.int32)  # llguidance's bitmask, one bit per token
        self._scores = np.empty(n_vocab, dtype=np.float32)  # the masked row mask() returns, reused each step
        # the closing path from the current state (its tokens), and the one from after a token vet() checked:
        # a path is fixed by the state it starts from, so a state reached along it needs no new measure
        self._path = None
        self._path_after = None
        self.mask_s = 0.0  # time spent computing and applying masks and advancing the matcher
        # the next mask, computed on the mask thread while the forward pass runs (advance starts it); the matcher's
        # stopped/accepting state is read before it starts, since the matcher cannot be used while it computes
        self._pending = None
        self._stopped = self._accepting = False

    def _compute(self) -> np.ndarray:
        if self._pending is not None:
            self._settle()
        else:
            self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the {self.spec.kind} constraint failed: {self.matcher.get_error()}")
        return self._words

    def _settle(self) -> None:
        """Wait for the mask started after the last token (if any): the matcher is free again after it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except (ValueError, RuntimeError) as e:  # llguidance's own refusal, as the decoding thread would see it
                raise GrammarError(f"the {self.spec.kind} constraint failed: {e}") from e

    def _start_next_mask(self) -> None:
        self._stopped, self._accepting = self.matcher.is_stopped(), self.matcher.is_accepting()
        if self._stopped or self.matcher.is_error() or not _MASK_THREAD:
            return
        self._pending = _mask_worker().submit(_compute_into, self.matcher, self._words)

    def allowed(self) -> np.ndarray:
        """The token ids the grammar allows next."""
        return allowed_ids(self._compute(), self.n_vocab)

    def mask(self, scores: np.ndarray, tokens_left: int | None = None) -> np.ndarray:
        """scores with every token the grammar forbids at -inf, in a buffer of this sequence that the next call
        overwrites. With tokens_left (the budget before max_tokens), once completing the grammar needs about all
        of them, only the closing path's token is left."""
        t0 = time.perf_counter()
        self._settle()
        if tokens_left is not None and not self.closing and self.spec.closable:
            self._plan_closing(tokens_left)
        words = self._compute()
        out = self._scores
        if self.closing:
            token = self._closing_token(words, self._string_state[0])
            out.fill(-np.inf)
            if token is not None:
                out[token] = scores[token]
            allowed = token is not None
        else:
            allowed = apply_bitmask(words, np.ascontiguousarray(scores, dtype=np.float32), out)
        self.mask_s += time.perf_counter() - t0
        if not allowed:
            raise GrammarError(f"the {self.spec.kind} constraint allows no token here")
        return out

    # -- the closing path: ending inside the budget -------------------------------------------------------------
    # A small model can fill a long string or array until max_tokens and leave JSON that does not parse. The
    # closing path is the grammar's own way out: from the current state, take the allowed token that closes the
    # most (a quote, brace or bracket), else the longest, until the grammar accepts. Its length is measured on a
    # copy of the matcher, again at intervals that halve with the slack; when it needs about every token left,
    # decoding follows it.

    def _closing_token(self, words: np.ndarray, in_string: bool):
        ranks = _closing_ranks(self.tokenizer)
        token = best_allowed(words, ranks[0 if in_string else 1], ranks[2 if in_string else 3])
        return None if token < 0 else int(token)

    def closing_length(self, limit: int, after: int | None = None) -> int:
        """Tokens the closing path takes from here (or from after this token) to where the grammar accepts
        (limit + 1: more than limit)."""
        known = self._path if after is None else self._path[1:] if self._path and self._path[0] == after else None
        if known is not None:
            return len(known) if len(known) <= limit else limit + 1
        self._settle()
        sim = self.matcher.deep_copy()
        words = np.empty_like(self._words)
        state = self._string_state
        if after is not None:
            if not sim.consume_token(after):
                return limit + 1
            state = _json_string_state(self.tokenizer.token_to_bytes(after), *state)
        path = []
        for n in range(limit + 1):
            if sim.is_accepting() or sim.is_stopped():
                if after is None:
                    self._path = path
                else:
                    self._path_after = (after, path)
                return n
            sim.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            token = None if sim.is_error() else self._closing_token(words, state[0])
            if token is None or not sim.consume_token(token):
                break
            path.append(token)
            state = _json_string_state(self.tokenizer.token_to_bytes(token), *state)
        return limit + 1

    def _plan_closing(self, tokens_left: int) -> None:
        if tokens_left > CLOSING_HORIZON or (self._next_check is not None and tokens_left > self._next_check):
            return
        needed = self.closing_length(tokens_left)
        slack = tokens_left - needed - 1
        self._vetting = 0 <= slack <= CLOSING_WATCH
        if needed > tokens_left:  # no way out within the budget: the model keeps its own choices
            self._next_check = tokens_left - 1
        elif slack <= 0:
            self.closing = True
        else:  # look again before the slack can be spent
            self._next_check = tokens_left - max(1, slack // 4)

    def vet(self, token: int, tokens_left: int) -> int:
        """The sampled token, or the closing path's where taking it would leave too few tokens to complete (a
        ',' that opens another item, a key whose value is long): checked on every token once the slack is small."""
        if not self._vetting or self.closing or token in self.tokenizer.eog_ids:
            return token
        t0 = time.perf_counter()
        if self.closing_length(tokens_left - 1, after=token) > tokens_left - 1:
            self.closing = True
            token = self._closing_token(self._words, self._string_state[0])
        self.mask_s += time.perf_counter() - t0
        return token

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        self._settle()
        ok = self.matcher.consume_token(int(token))
        if self._path and self._path[0] == token:
            self._path = self._path[1:]
        elif self._path_after is not None and self._path_after[0] == token:
            self._path = self._path_after[1]
        else:
            self._path = None
        self._path_after = None
        if self.spec.closable:
            self._string_state = _json_string_state(self.tokenizer.token_to_bytes(int(token)), *self._string_state)
        if ok:
            self._start_next_mask()
        self.mask_s += time.perf_counter() - t0
        if not ok:
            raise GrammarError(f"the {self.spec.kind} constraint rejected token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing more can follow (only an end-of-generation token would), or the closing path has ended."""
        if self._pending is not None:  # as read when the mask started
            return self._stopped or (self.closing and self._accepting)
        return self.matcher.is_stopped() or (self.closing and self.matcher.is_accepting())

    @property
    def accepting(self) -> bool:
        if self._pending is not None:
            return self._accepting
        return self.matcher.is_accepting()


# The next token's mask is computed on one background thread while the forward pass runs: it depends only on the
# tokens so far. llguidance releases the GIL while it computes, so the mask overlaps the forward's Python and its
# kernels. EDGELLM_MASK_THREAD=0 computes every mask in the decoding thread instead.
_MASK_THREAD = os.environ.get("EDGELLM_MASK_THREAD", "1") != "0"
_WORKER = (None, 0)  # (the thread pool, the process it was started in: a forked child starts its own)
_WORKER_LOCK = threading.Lock()


def _mask_worker():
    global _WORKER
    with _WORKER_LOCK:
        worker, pid = _WORKER
        if worker is None or pid != os.getpid():
            worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-mask")
            _WORKER = (worker, os.getpid())
        return worker


def _compute_into(matcher, words) -> None:
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)


def accepts(spec: ConstraintSpec, tokenizer, token_ids) -> bool:
    """Whether these tokens form a complete string of the grammar (an independent check for outputs)."""
    llg = _llg()
    matcher = llg.LLMatcher(llg_tokenizer(tokenizer), spec.grammar, log_level=0)
    return matcher.consume_tokens([int(t) for t in token_ids]) and matcher.is_accepting()


def text_accepted(spec: ConstraintSpec, tokenizer, text: str) -> bool:
    """Whether text is a complete string of the grammar, whatever tokens would spell it."""
    llg = _llg()
    lltok = llg_tokenizer(tokenizer)
    matcher = llg.LLMatcher(lltok, spec.grammar, log_level=0)
    ids = lltok.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()
