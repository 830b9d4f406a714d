"""The regex pre-tokenizers against a plain port of llama.cpp's hand-written splitters (src/unicode.cpp:
unicode_regex_split_custom_gpt2 / _llama3 / _qwen2), on random text mixing every category the splitters care
about; and llama.cpp's Unicode tables as the tokenizer module carries them."""
import random
import unicodedata

import numpy as np
import pytest

from edgellm.tokenizer import unicode_classes as uc
from edgellm.tokenizer.pretokenize import GPT2, GPT4O, LLAMA3, QWEN2, PreTokenizer

N_RANDOM_STRINGS = 400  # enough to hit every branch of the splitters many times; runs in well under a second

# characters chosen to exercise each branch: contractions, letters/numbers/marks in and outside the BMP,
# llama.cpp-only whitespace (NEL, NBSP, U+3000) and Python-only whitespace (\x1c), unassigned and control
ALPHABET = (list("abcXYZ'stmdrevlSTM019 .,!?-_()[]$+<=>^`|~\"#") + [" "] * 8 + ["\t", "\n", "\r", "\r\n"]
            + ["é", "ß", "Ж", "ω", "多", "線", "ー", "\u0301", "\u0903", "²", "½", "٣", "\u00a0", "\u0085",
               "\u3000", "\u2028", "\x1c", "\x00", "\u00ad", "\u0378", "©", "€", "™",
               "\U0001F642", "\U0001F9CC", "\U00010400", "\U0001D7CE", "\U0001E4D0", "\U000E0001", "\U00031350"])


def _random_strings(seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(N_RANDOM_STRINGS)]


class _Segment:
    """Position queries on one segment, out-of-range positions having no flags, as in llama.cpp's _get_flags."""

    def __init__(self, text):
        self.text, self.n = text, len(text)

    def inside(self, p):
        return 0 <= p < self.n

    def cls(self, p):
        return uc.category_of(ord(self.text[p])) if self.inside(p) else None

    def ws(self, p):
        return self.inside(p) and ord(self.text[p]) in uc.WHITESPACE

    def letter(self, p):
        return self.cls(p) == "L"

    def number(self, p):
        return self.cls(p) == "N"

    def other(self, p):  # [^\s\p{L}\p{N}] with flags: inside the segment and none of the three
        return self.inside(p) and not (self.ws(p) or self.letter(p) or self.number(p))


def reference_gpt2(text):
    s, out, pos = _Segment(text), [], 0
    while pos < s.n:
        start, c = pos, text[pos]
        if c == "'" and pos + 1 < s.n and text[pos + 1] in "stmd":
            pos += 2
        elif c == "'" and pos + 2 < s.n and text[pos + 1:pos + 3] in ("re", "ve", "ll"):
            pos += 3
        else:
            p2 = pos + 1 if c == " " else pos
            for test in (s.letter, s.number, s.other):
                if test(p2):
                    pos = p2
                    while test(pos):
                        pos += 1
                    break
            else:
                run = 0
                while s.ws(pos + run):
                    run += 1
                if run > 1 and pos + run < s.n:
                    pos += run - 1
                elif run > 0:
                    pos += run
                else:
                    pos += 1
        out.append(text[start:pos])
    return out


def reference_llama3(text, max_digits=3):
    s, out, pos = _Segment(text), [], 0

    def add(end):
        nonlocal pos
        out.append(text[pos:end])
        pos = end

    while pos < s.n:
        c = text[pos]
        lower = lambda p: text[p].lower() if text[p].isascii() else text[p]  # noqa: E731 (unicode_tolower, ASCII)
        if c == "'" and pos + 1 < s.n and lower(pos + 1) in "stmd":
            add(pos + 2)
            continue
        if c == "'" and pos + 2 < s.n and lower(pos + 1) + lower(pos + 2) in ("re", "ve", "ll"):
            add(pos + 3)
            continue
        if not (c in "\r\n" or s.number(pos)) and (s.letter(pos) or s.letter(pos + 1)):
            end = pos + 1
            while s.letter(end):
                end += 1
            add(end)
            continue
        if s.number(pos):
            end = pos
            while s.number(end):
                end += 1
                if end - pos >= max_digits:
                    add(end)
            if end > pos:
                add(end)
            continue
        p2 = pos + 1 if c == " " else pos
        if not (s.ws(p2) or s.letter(p2) or s.number(p2)):   # llama.cpp tests the current char's flags here
            end = pos + (c == " ")
            while s.other(end):
                end += 1
            while end < s.n and text[end] in "\r\n":
                end += 1
            add(end)
            continue
        run, last_newline_end = 0, 0
        while s.ws(pos + run):
            if text[pos + run] in "\r\n":
                last_newline_end = pos + run + 1
            run += 1
        if last_newline_end > 0:
            add(last_newline_end)
        elif run > 1 and pos + run < s.n:
            add(pos + run - 1)
        elif run > 0:
            add(pos + run)
        else:
            add(pos + 1)
    return out


def reference_smollm(text):
    digits_split = []   # first regex \p{N}: every number character becomes its own piece
    for ch in text:
        if uc.category_of(ord(ch)) == "N" or not digits_split or uc.category_of(ord(digits_split[-1][-1])) == "N":
            digits_split.append(ch)
        else:
            digits_split[-1] += ch
    return [w for seg in digits_split for w in reference_gpt2(seg)]


@pytest.mark.parametrize("chain, reference", [
    ([GPT2], reference_gpt2),
    ([LLAMA3], reference_llama3),
    ([QWEN2], lambda t: reference_llama3(t, max_digits=1)),
    ([r"\p{N}", GPT2], reference_smollm),
], ids=["gpt2", "llama3", "qwen2", "smollm"])
def test_regex_splitter_matches_llama_cpp_hand_written_splitter(chain, reference):
    pre = PreTokenizer(chain)
    for text in _random_strings(seed=len(chain[-1])):
        assert pre.split(text) == reference(text), repr(text)


def test_splitter_pieces_cover_the_text():
    pre = PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])   # llama.cpp 'default'
    for text in _random_strings(seed=7):
        pieces = pre.split(text)
        assert "".join(pieces) == text and all(pieces)


def test_known_splits():
    smollm = PreTokenizer([r"\p{N}", GPT2])
    assert smollm.split("1234 and 3.14") == ["1", "2", "3", "4", " and", " ", "3", ".", "1", "4"]
    assert smollm.split("a   b\tc\n\nd") == ["a", "  ", " b", "\t", "c", "\n", "\n", "d"]
    llama3 = PreTokenizer([LLAMA3])
    assert llama3.split("I'M 12345 ok!\n\n  x") == ["I", "'M", " ", "123", "45", " ok", "!\n\n", " ", " x"]
    # o200k (gpt-oss): case runs split words ("HTTPServer" stays one: capitals then lower case), contractions
    # attach, a punctuation run takes trailing newlines and slashes. Non-ASCII letters count as both cases, as in
    # llama.cpp's rewrite of the pattern ([^a-z] / [^A-Z] over letters), so "É" extends a lower-case run.
    gpt4o = PreTokenizer([GPT4O])
    assert gpt4o.split("HelloWorld's HTTPServer 12345 naïveÉTÉ foo//\nbar") == [
        "Hello", "World's", " HTTPServer", " ", "123", "45", " naïveÉ", "TÉ", " foo", "//\n", "bar"]


def pretokenizer_texts(n=600, seed=0):
    """Seeded texts for the pre-tokenizers recorded from llama.cpp (tools/record_pretokenizer_llama_cpp.py): case
    runs, contractions, digit runs, punctuation with newlines and slashes, accented and non-Latin letters, an emoji."""
    rng = random.Random(seed)
    parts = list("abcXYZ ÉéïñßΣσДд日本\n\t/'’.,!?0123456789") + ["'s", "'T", "HTTP", "Server", "  ", "\r\n", "🙂"]
    return ["HelloWorld's HTTPServer 12345 naïveÉTÉ foo//\nbar", "I'M don'T WE'LL", "x = f(a,b)/2\n\n  # ok"] + [
        "".join(rng.choice(parts) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def test_gpt4o_tokens_match_llama_cpp(smollm2_path):
    """The gpt-4o pre-tokenizer (gpt-oss) over SmolLM2's vocabulary and merges: every text's ids equal llama.cpp's
    (tests/fixtures/llama_cpp_pretokenizer_gpt-4o.npz)."""
    from conftest import FIXTURES
    from edgellm.engine import gguf
    from edgellm.tokenizer import Tokenizer
    rec = np.load(FIXTURES / "llama_cpp_pretokenizer_gpt-4o.npz")
    texts = pretokenizer_texts()
    assert int(rec["n_texts"]) == len(texts)
    with gguf.open(smollm2_path) as f:
        tok = Tokenizer.from_metadata({**f.metadata, "tokenizer.ggml.pre": "gpt-4o"})
    off = rec["offsets"]
    bad = [t for i, t in enumerate(texts) if tok.encode(t, add_special=False) != rec["ids"][off[i]:off[i + 1]].tolist()]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {bad[0]!r}"


def test_category_table_matches_unicodedata_patched_to_ucd_15_1():
    if unicodedata.unidata_version != "14.0.0":
        pytest.skip("the checked-in table was generated from unicodedata 14.0.0 plus the 15.0/15.1 patch")
    from edgellm.tokenizer._unicode_ranges import CATEGORY_RUNS
    assert uc.compute_category_runs() == CATEGORY_RUNS


def test_astral_stand_ins_keep_the_category():
    for cls, stand_in in uc.ASTRAL_STAND_IN.items():
        assert uc.category_of(ord(stand_in)) == cls and ord(stand_in) not in uc.WHITESPACE
    astral_classes = {cls for cls in "ULNPSMZC" for first, last in uc.class_ranges(cls) if last > 0xFFFF}
    assert astral_classes <= set(uc.ASTRAL_STAND_IN)
    text = "a\U0001F642\U00010400\U0001D7CE\U000E0001\U0003FFFF"
    collapsed = uc.collapse_astral(text)
    assert len(collapsed) == len(text)
    assert [uc.category_of(ord(c)) for c in collapsed] == [uc.category_of(ord(c)) for c in text]


def test_llama_cpp_specific_categories():
    assert uc.category_of(0x31350) == "L"    # CJK Extension H: Unicode 15.0, unassigned in unicodedata 14.0
    assert uc.category_of(0x1C89) == "U"     # Unicode 16.0: llama.cpp's tables predate it
    assert 0x85 in uc.WHITESPACE and 0x1C not in uc.WHITESPACE
