"""Fuzz both real tokenizers: random text into encode, random id lists into decode, mutated metadata into
Tokenizer.from_metadata. Every outcome must be success or TokenizerError; anything else is a crash, a case over
--time-limit is a hang.

    EDGELLM_MODELS=/work/mc python tools/fuzz_tokenizer.py --cases 100000
    python tools/fuzz_tokenizer.py --replay 4711

Case i of seed s draws from random.Random(f"{s}:{i}") and picks one tokenizer and one kind:
  text      random text from many scripts, controls, combining marks, emoji sequences, BPE/SPM marker characters,
            partial special-token texts; with lone surrogates (undecodable bytes carried as str through
            surrogateescape) TokenizerError is required, otherwise success, ids in range, and decode(encode(t))
            giving t back (Gemma turns a literal U+2581 into a space, as llama.cpp does);
  special   one special token's text (cycling through all of them) between random text, with parse_special
            on and off: the same round trip, with special=True;
  long      20k-200k characters of one kind (one endless word, spaces, newlines, digits, emoji);
  decode    random id lists, out-of-range ids (negative, n_vocab, 2**63...) in some: TokenizerError exactly when
            one is out of range, else a str, and token_to_bytes gives bytes for every id;
  metadata  the vocabulary cut to its first KEEP tokens, then keys deleted or given values of another type,
            length or range, as a corrupt GGUF could carry them.
Before the random cases, every special token of both vocabularies (6,431) is checked alone: it encodes to itself
with parse_special, decodes to its text with special=True, and round-trips as plain text without.

Sections: text generators; the checks per kind; the campaign and its report.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_gguf import limit_address_space, message_kind  # noqa: E402

from edgellm.store import catalog
from edgellm.engine import gguf  # noqa: E402
from edgellm.errors import TokenizerError  # noqa: E402
from edgellm.tokenizer import Tokenizer  # noqa: E402
from edgellm.tokenizer.unicode_classes import BYTE_TO_UNICODE  # noqa: E402
from edgellm.tokenizer.vocab import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED  # noqa: E402

MODELS = ("smollm2-135m", "gemma-3-270m")
KEEP = 600                     # metadata cases: first tokens kept (Gemma's byte tokens are ids 238-493)
SPM_SPACE = "\u2581"
LONG_LENGTHS = (20_000, 20_000, 50_000, 100_000, 200_000)   # characters; the test sample passes shorter ones
OUT_OF_RANGE = (-1, -2, -(2**31), -(2**63), 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**100)

# ---------------------------------------------------------------------------------------------------------------
# Text generators
# ---------------------------------------------------------------------------------------------------------------


def _chars(*ranges) -> str:
    return "".join(chr(c) for lo, hi in ranges for c in range(lo, hi + 1))


POOLS = {
    "ascii": "".join(chr(c) for c in range(32, 127)),
    "letters": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "space": " \t\n\r\x0b\x0c\u00a0\u1680\u2000\u2009\u200a\u2028\u2029\u202f\u205f\u3000\u200b\ufeff  \n\n",
    "control": _chars((0, 31), (127, 159)),
    "latin": _chars((0xA0, 0x24F)),
    "combining": _chars((0x300, 0x36F), (0x1AB0, 0x1ABE), (0x20D0, 0x20F0)),
    "cjk": _chars((0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00)),
    "rtl_indic": _chars((0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE5B)),
    "emoji": _chars((0x1F300, 0x1F64F), (0x1F900, 0x1F9FF)) + "\u200d\ufe0f\U0001F3FB\U0001F3FF\u2764",
    "astral": _chars((0x10000, 0x100FF), (0x1D400, 0x1D4FF), (0x20000, 0x200FF), (0xE0000, 0xE007F)),
    "private": _chars((0xE000, 0xE0FF)) + "\ufdd0\ufffe\uffff\U0010FFFF\U000FFFFD\ufffd",
    "markers": "ĠĊċ▁▁▁âĀāĉ" + "\u2581" * 3,
    "digits": "0123456789٠١٢٣١२३٤૧௧0123456789",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~“”‘’…—–«»¿¡·•§¶",
    "contractions": "'s't're've'm'll'd'S'T'RE'VE'M'LL'D",
    "special_bits": "<|>_ </s><s>[]{}endoftextim_startof_turn0x0A",
}
POOL_NAMES = sorted(POOLS)
WORDS = ("the", "The", " quick", "naïve", "café", "Straße", "东京", "中文", "日本語", "한국어", "Ελληνικά", "русский",
         "العربية", "हिन्दी", "don't", "I'M", "3.14159", "1234567", "<|im_start|>", "<start_of_turn>", "<eos>",
         "<0x0A>", "<pad>", "\r\n", "  ", "\t\t", "🙂", "👨‍👩‍👧‍👦", "🇫🇷", "e\u0301", "ﬁ", "Å", "x²", "½")
SURROGATES = _chars((0xD800, 0xDFFF))


def random_text(rng: random.Random, allow_surrogates: bool) -> str:
    parts = []
    for _ in range(rng.randint(1, 30)):
        roll = rng.random()
        if roll < 0.25:
            parts.append(rng.choice(WORDS))
        elif roll < 0.9:
            pool = POOLS[rng.choice(POOL_NAMES)]
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 20))))
        elif roll < 0.97:   # undecodable bytes, carried in a str as surrogateescape does
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 12)))
            text = raw.decode("utf-8", "surrogateescape")
            parts.append(text if allow_surrogates else raw.decode("utf-8", "replace"))
        elif allow_surrogates:
            parts.append(rng.choice(SURROGATES))
    return "".join(parts)


def long_text(rng: random.Random, lengths=LONG_LENGTHS) -> str:
    n = rng.choice(lengths)
    unit = rng.choice(("x", "ab", " ", "\n", "9", "🙂", "é", "\u2581", "a ", "Ġ", ". ", "\t\n", "東", "<|", "\x00",
                       "e\u0301", "hello world "))
    return (unit * (n // len(unit) + 1))[:n]


def has_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


# ---------------------------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------------------------

class Violation(AssertionError):
    pass


class CaseTimeout(BaseException):
    pass


@dataclass
class Subject:
    name: str
    tokenizer: Tokenizer
    metadata: dict            # the vocabulary cut to KEEP tokens, for the metadata cases
    specials: list            # ids of control, user-defined and unknown tokens
    missing_bytes: frozenset = frozenset()  # byte-level BPE: bytes whose character is not a token

    @property
    def spm(self) -> bool:
        return self.tokenizer.vocab.model == "llama"


def expected_round_trip(subject: Subject, text: str) -> str | None:
    """What decode(encode(text)) must give, or None when llama.cpp itself would mangle the text.

    SPM spells spaces as U+2581, so a literal U+2581 comes back as a space. Byte-level BPE drops a byte whose
    character is not in the vocabulary (SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and the lead bytes of
    code points from U+40000): a lone such ASCII character vanishes, a longer character would come back broken."""
    if subject.spm:
        return text.replace(SPM_SPACE, " ")
    missing = subject.missing_bytes
    out = []
    for ch in text:
        raw = ch.encode("utf-8")
        if missing.isdisjoint(raw):
            out.append(ch)
        elif len(raw) > 1:
            return None
    return "".join(out)


def check_ids(tok: Tokenizer, ids) -> None:
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < tok.n_vocab for i in ids):
        raise Violation(f"encode gave something other than ids in [0, {tok.n_vocab})")


def check_encode(subject: Subject, text: str, parse_special: bool, add_special: bool) -> str:
    tok = subject.tokenizer
    try:
        ids = tok.encode(text, add_special=add_special, parse_special=parse_special)
    except TokenizerError as e:
        if has_surrogate(text):
            return str(e)
        raise Violation(f"valid text refused: {e}") from None
    if has_surrogate(text):
        raise Violation("text with a lone surrogate was tokenized")
    check_ids(tok, ids)
    if add_special and tok.add_bos:       # the BOS that add_special put in front
        ids = ids[1:]
    if add_special and tok.add_eos:
        ids = ids[:-1]
    got = tok.decode(ids, special=parse_special)
    want = expected_round_trip(subject, text)
    if want is not None and got != want:
        raise Violation(f"round trip changed the text: {want[:60]!r} -> {got[:60]!r}")
    return ""


def check_decode(rng: random.Random, subject: Subject) -> str:
    tok = subject.tokenizer
    n = tok.n_vocab
    ids = [rng.randrange(n) for _ in range(rng.randint(0, 40))]
    if rng.random() < 0.3:
        ids += rng.sample(subject.specials, min(5, len(subject.specials)))
    if rng.random() < 0.3:
        ids += [tok.vocab.token_to_id.get(f"<0x{b:02X}>", rng.randrange(n)) for b in rng.sample(range(128, 256), 6)]
    bad = rng.random() < 0.4
    if bad:
        ids.insert(rng.randint(0, len(ids)), rng.choice(OUT_OF_RANGE + (n, n + 1)))
    rng.shuffle(ids)
    as_numpy = rng.random() < 0.3 and not bad
    seq = np.array(ids, dtype=rng.choice((np.int32, np.int64, np.uint32))) if as_numpy else ids
    special = rng.random() < 0.5
    try:
        text = tok.decode(seq, special=special)
    except TokenizerError as e:
        if bad:
            return str(e)
        raise Violation(f"in-range ids refused: {e}") from None
    if bad:
        raise Violation("decode accepted an out-of-range id")
    if not isinstance(text, str):
        raise Violation("decode did not return a str")
    for i in ids[:10]:
        if not isinstance(tok.token_to_bytes(int(i), special=special), bytes):
            raise Violation("token_to_bytes did not return bytes")
    return ""


def condensed_metadata(metadata) -> dict:
    md = {}
    for key in metadata.keys():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            value = metadata[key]
            md[key] = value[:KEEP] if isinstance(value, (list, np.ndarray)) else value
    return md


def _hostile_value(rng: random.Random, old):
    n = len(old) if isinstance(old, (list, np.ndarray)) else 8
    return rng.choice((
        None, 0, 1, -1, 2**31, 2**63, 2**64 - 1, 1.5, float("nan"), float("inf"), True, False, "", "gpt2", "llama",
        "smollm", "default", "x" * 300, [], ["a"], ["a", "a"], ["", "b"], ["a b"] * 3,
        np.zeros(0, np.int32), np.arange(n, dtype=np.int32), np.full(n, 6, np.int32), np.full(n, -7, np.int32),
        np.full(n, 2**31 - 1, np.int64), np.array([np.nan] * n, np.float32), np.ones(n, np.float32),
        np.zeros(n, np.uint8), np.ones(n, bool), np.arange(n, dtype=np.uint64) * 2**60,
        (old[: max(len(old) // 2, 1)] if isinstance(old, (list, np.ndarray)) else old),
    ))


def mutate_metadata(rng: random.Random, md: dict) -> dict:
    md = dict(md)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(sorted(md) + ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.fim_pad_token_id",
                                       "tokenizer.ggml.add_eos_token"])
        roll = rng.random()
        if roll < 0.15:
            md.pop(key, None)
        elif roll < 0.35 and isinstance(md.get(key), list):     # edit entries of a token/merge list
            items = list(md[key])
            for _ in range(rng.randint(1, 5)):
                if items:
                    i = rng.randrange(len(items))
                    items[i] = rng.choice(("", "<0xZZ>", "<0x", items[-1], "<|im_end|>", "\u2581", "Ġ Ġ",
                                           "a  b", "\ufffd", items[i] * 2))
            md[key] = items
        elif roll < 0.5 and isinstance(md.get(key), np.ndarray) and md[key].size:   # edit array entries
            arr = md[key].copy()
            idx = rng.randrange(arr.size)
            if arr.dtype.kind in "iu":
                arr[idx] = rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 99, np.iinfo(arr.dtype).max, np.iinfo(arr.dtype).min))
            elif arr.dtype.kind == "f":
                arr[idx] = rng.choice((np.nan, np.inf, -np.inf, 1e30))
            md[key] = arr
        else:
            md[key] = _hostile_value(rng, md.get(key))
    return {k: v for k, v in md.items() if v is not None}


def check_metadata(rng: random.Random, subject: Subject) -> str:
    md = mutate_metadata(rng, subject.metadata)
    try:
        tok = Tokenizer.from_metadata(md)
        for parse_special in (False, True):
            check_ids(tok, tok.encode(random_text(rng, False), parse_special=parse_special))
        text = tok.decode(range(min(tok.n_vocab, KEEP)), special=True)
        if not isinstance(text, str):
            raise Violation("decode did not return a str")
        try:
            tok.decode([tok.n_vocab])
        except TokenizerError:
            return ""
        raise Violation("decode accepted id n_vocab")
    except TokenizerError as e:
        return str(e)


def check_special_alone(subject: Subject, token_id: int) -> str:
    """A special token's own text encodes to exactly that token with parse_special, decodes back to the text with
    special=True, and round-trips as plain text without parse_special."""
    tok = subject.tokenizer
    text = tok.vocab.tokens[token_id]
    ids = tok.encode(text, add_special=False, parse_special=True)
    if ids != [token_id]:
        raise Violation(f"special token {token_id} {text!r} encodes to {ids[:8]}")
    if tok.decode([token_id], special=True) != text:
        raise Violation(f"special token {token_id} {text!r} does not decode to its text")
    return check_encode(subject, text, False, False)


def run_case(index: int, seed: int, subjects: list[Subject], long_lengths=LONG_LENGTHS) -> tuple[str, str, str]:
    """(kind, subject name, error message or '') for case `index`; raises on a crash or violation."""
    rng = random.Random(f"{seed}:{index}")
    subject = subjects[index % len(subjects)]
    roll = rng.random()
    if roll < 0.50:
        text = random_text(rng, allow_surrogates=rng.random() < 0.2)
        return "text", subject.name, check_encode(subject, text, rng.random() < 0.5, rng.random() < 0.5)
    if roll < 0.62:
        token_id = subject.specials[(index // len(subjects)) % len(subject.specials)]
        text = random_text(rng, False)[:20] + subject.tokenizer.vocab.tokens[token_id] + random_text(rng, False)[:20]
        return "special", subject.name, check_encode(subject, text, rng.random() < 0.7, False)
    if roll < 0.625:
        return "long", subject.name, check_encode(subject, long_text(rng, long_lengths), rng.random() < 0.5, True)
    if roll < 0.90:
        return "decode", subject.name, check_decode(rng, subject)
    return "metadata", subject.name, check_metadata(rng, subject)


# ---------------------------------------------------------------------------------------------------------------
# The campaign
# ---------------------------------------------------------------------------------------------------------------

def load_subjects() -> list[Subject]:
    subjects = []
    for name in MODELS:
        path = catalog.models_dir() / catalog.lookup(name).file
        if not path.is_file():
            continue
        with gguf.open(path) as f:
            tok = Tokenizer.from_metadata(f.metadata)
            md = condensed_metadata(f.metadata)
        specials = np.nonzero(tok.vocab.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0].tolist()
        missing = frozenset() if tok.vocab.model == "llama" else frozenset(
            b for b in range(256) if BYTE_TO_UNICODE[b] not in tok.vocab.token_to_id)
        subjects.append(Subject(name, tok, md, specials, missing))
    if not subjects:
        raise SystemExit("no real model on disk: set EDGELLM_MODELS (e.g. /work/mc)")
    return subjects


def _on_alarm(signum, frame):
    raise CaseTimeout()


@dataclass
class Report:
    cases: int = 0
    kinds: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)     # time spent per kind of case
    messages: set = field(default_factory=set)
    crashes: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    slowest_s: float = 0.0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        return {"cases": self.cases, "kinds": self.kinds, "seconds_per_kind": {k: round(v, 1) for k, v in
                                                                              self.seconds.items()},
                "distinct_error_messages": len(self.messages),
                "distinct_error_kinds": len({message_kind(m) for m in self.messages}),
                "crashes": len(self.crashes), "hangs": len(self.hangs), "crash_examples": self.crashes[:20],
                "hang_examples": self.hangs[:20], "slowest_case_s": round(self.slowest_s, 3),
                "elapsed_s": round(self.elapsed_s, 1)}


def run_campaign(cases: int, seed: int = 0, start: int = 0, time_limit_s: float = 20.0,
                 subjects: list[Subject] | None = None, progress: bool = False, long_lengths=LONG_LENGTHS,
                 all_specials: bool = False) -> Report:
    """`cases` random cases; with all_specials, first one case per special token of every tokenizer."""
    subjects = load_subjects() if subjects is None else subjects
    report = Report()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    t_start = time.perf_counter()
    every_special = [(s, t) for s in subjects for t in s.specials] if all_specials else []
    try:
        for index in range(start - len(every_special), start + cases):
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, time_limit_s)
            try:
                if index < start:
                    subject, token_id = every_special[index - start + len(every_special)]
                    kind, name, message = "every_special", subject.name, check_special_alone(subject, token_id)
                else:
                    kind, name, message = run_case(index, seed, subjects, long_lengths)
                outcome = "error" if message else "ok"
            except CaseTimeout:
                kind, outcome, message = "?", "hang", ""
                report.hangs.append({"case": index})
            except BaseException as e:  # noqa: BLE001 - a crash is what we are looking for
                if isinstance(e, KeyboardInterrupt):
                    raise
                kind, outcome, message = "?", "crash", ""
                report.crashes.append({"case": index, "error": f"{type(e).__name__}: {e}"[:300]})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            spent = time.perf_counter() - t0
            report.slowest_s = max(report.slowest_s, spent)
            report.seconds[kind] = report.seconds.get(kind, 0.0) + spent
            report.cases += 1
            per_kind = report.kinds.setdefault(kind, {})
            per_kind[outcome] = per_kind.get(outcome, 0) + 1
            if message:
                report.messages.add(message)
            if progress and report.cases % 5000 == 0:
                print(f"  {report.cases} cases, {len(report.crashes)} crashes, {time.perf_counter() - t_start:.0f} s",
                      file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGALRM, old)
    report.elapsed_s = time.perf_counter() - t_start
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--mem-limit-mb", type=int, default=2048, help="address space allowed beyond the start's")
    ap.add_argument("--replay", type=int)
    ap.add_argument("--no-specials", action="store_true", help="skip the pass over every special token")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    subjects = load_subjects()
    if args.replay is not None:
        try:
            print(run_case(args.replay, args.seed, subjects))
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            return 1
        return 0
    if args.mem_limit_mb > 0:
        limit_address_space(args.mem_limit_mb)
    report = run_campaign(args.cases, args.seed, args.start, args.time_limit, subjects, progress=not args.json,
                          all_specials=not args.no_specials)
    result = report.as_dict()
    result.update(seed=args.seed, models=[s.name for s in subjects], mem_limit_mb=args.mem_limit_mb)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
        print(f"reproduce: python tools/fuzz_tokenizer.py --cases {args.cases} --seed {args.seed}")
    return 1 if report.crashes or report.hangs else 0


if __name__ == "__main__":
    sys.exit(main())
