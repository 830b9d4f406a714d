"""Unicode character classes exactly as llama.cpp's tokenizer sees them, as Python `re` class text.

llama.cpp gives every code point one category flag (letter, number, punctuation, symbol, mark, separator, control,
undefined) from tables generated from UCD 15.1 (src/unicode-data.cpp), plus an explicit whitespace set. Python's
`re` has no \\p{L}, so the pre-tokenizer patterns are rewritten with explicit ranges built from those categories.
Scanning 1.1M code points with `unicodedata` is slow at import, so the category runs are precomputed in
`_unicode_ranges.py`; regenerate it with `python -m edgellm.tokenizer.unicode_classes`.

Speed: `re` tests a set's code points above U+FFFF one range at a time (hundreds of ranges for \\p{L}), which made
the splitter several times slower. So the sets hold BMP ranges only, and text containing astral characters is first
"collapsed": each astral character becomes a BMP stand-in of the same category (`collapse_astral`), the way
llama.cpp collapses code points for std::regex. Lengths are unchanged, so match spans carry over.

Sections: category runs and the UCD 15.0/15.1 patch; class text and pattern translation; GPT-2 byte map.
"""
import bisect
import functools
import re
import unicodedata

# llama.cpp's whitespace set (Unicode White_Space; NOT Python's str.isspace, which adds \x1c-\x1f).
WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                        0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

# One letter per llama.cpp category flag.
_CATEGORY_CLASS = {"Cn": "U", "Cc": "C", "Cf": "C", "Co": "C", "Cs": "C", "Mc": "M", "Me": "M", "Mn": "M",
                   "Nd": "N", "Nl": "N", "No": "N", "Zl": "Z", "Zp": "Z", "Zs": "Z"}

# Code points assigned in Unicode 15.0/15.1, which this interpreter's unicodedata (14.0.0) calls unassigned but
# llama.cpp's UCD 15.1 tables classify: (first, last, class). Checked against llama.cpp's unicode-data.cpp.
UCD_15_ADDITIONS = (
    (0x0CF3, 0x0CF3, "M"), (0x0ECE, 0x0ECE, "M"), (0x2FFC, 0x2FFF, "S"), (0x31EF, 0x31EF, "S"),
    (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"), (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"),
    (0x11F00, 0x11F01, "M"), (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"), (0x11F43, 0x11F4F, "P"),
    (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"), (0x13439, 0x1343F, "C"), (0x13440, 0x13440, "M"),
    (0x13441, 0x13446, "L"), (0x13447, 0x13455, "M"), (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"),
    (0x1D2C0, 0x1D2D3, "N"), (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"), (0x1F6DC, 0x1F6DC, "S"),
    (0x1F774, 0x1F776, "S"), (0x1F77B, 0x1F77F, "S"), (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"),
    (0x1FA87, 0x1FA88, "S"), (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"), (0x1FAF7, 0x1FAF8, "S"),
    (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"), (0x31350, 0x323AF, "L"),
)
_SUPPORTED_UNIDATA = ("14.0.0", "15.0.0", "15.1.0")  # versions the patch above lifts to exactly 15.1

MAX_CODEPOINT = 0x110000


def compute_category_runs() -> str:
    """The category runs llama.cpp uses, as 'start_hex:class' items: each run lasts until the next start."""
    if unicodedata.unidata_version not in _SUPPORTED_UNIDATA:
        raise RuntimeError(f"unicodedata {unicodedata.unidata_version} differs from llama.cpp's UCD 15.1 tables")
    classes = [_CATEGORY_CLASS.get(c) or c[0] for c in map(unicodedata.category, map(chr, range(MAX_CODEPOINT)))]
    for first, last, cls in UCD_15_ADDITIONS:
        classes[first:last + 1] = [cls] * (last - first + 1)
    runs = [(0, classes[0])]
    for cp in range(1, MAX_CODEPOINT):
        if classes[cp] != runs[-1][1]:
            runs.append((cp, classes[cp]))
    return " ".join(f"{start:x}:{cls}" for start, cls in runs)


@functools.lru_cache(maxsize=1)
def _runs():
    from ._unicode_ranges import CATEGORY_RUNS  # a large generated table, read once on first use
    items = [item.split(":") for item in CATEGORY_RUNS.split()]
    return [int(start, 16) for start, _ in items], [cls for _, cls in items]


@functools.lru_cache(maxsize=None)
def class_ranges(cls: str) -> tuple:
    """Inclusive (first, last) code point ranges of one category class ('L', 'N', 'P', 'S', 'M', ...)."""
    starts, classes = _runs()
    ends = starts[1:] + [MAX_CODEPOINT]
    return tuple((start, end - 1) for start, end, c in zip(starts, ends, classes) if c == cls)


def category_of(cp: int) -> str:
    """The llama.cpp category class of one code point: 'L', 'N', 'P', 'S', 'M', 'Z', 'C' or 'U' (unassigned)."""
    starts, classes = _runs()
    return classes[bisect.bisect_right(starts, cp) - 1]


# BMP stand-ins for astral characters, one per category (none is ASCII or whitespace; astral has no separators)
ASTRAL_STAND_IN = {"L": "\u4e00", "N": "\u00b2", "P": "\u00a1", "S": "\u00a2", "M": "\u0300", "C": "\u00ad",
                   "U": "\u0378"}
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def collapse_astral(text: str) -> str:
    """Replace each character above U+FFFF by the BMP stand-in of its category (same length, same matches)."""
    return _ASTRAL.sub(lambda m: ASTRAL_STAND_IN[category_of(ord(m.group()))], text)


def _ranges_text(ranges) -> str:
    # every code point escaped, so no character inside a [...] set can be read as syntax
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


def _whitespace_ranges():
    out = []
    for cp in sorted(WHITESPACE):
        if out and out[-1][1] == cp - 1:
            out[-1][1] = cp
        else:
            out.append([cp, cp])
    return out


@functools.lru_cache(maxsize=None)
def class_text(name: str) -> str:
    """Set-body text (no brackets, BMP only) for a llama.cpp class: 'L', 'N', 'P', 'S', 'M' or 's' (whitespace)."""
    if name == "s":
        return _ranges_text(_whitespace_ranges())
    if name not in "LNPSM":
        raise ValueError(f"unsupported unicode class \\p{{{name}}}")
    return _ranges_text((first, min(last, 0xFFFF)) for first, last in class_ranges(name) if first <= 0xFFFF)


def translate_pattern(pattern: str) -> str:
    """Rewrite a llama.cpp pre-tokenizer regex for Python `re`: \\p{X}, \\s and \\S become explicit sets with
    llama.cpp's categories, and capturing groups become non-capturing (so `findall` returns whole matches)."""
    out, i, inside = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            nxt = pattern[i + 1]
            if nxt == "p" and pattern[i + 2] == "{":
                end = pattern.index("}", i)
                body = class_text(pattern[i + 3:end])
                out.append(body if inside else f"[{body}]")
                i = end + 1
                continue
            if nxt == "s":
                out.append(class_text("s") if inside else f"[{class_text('s')}]")
            elif nxt == "S":
                if inside:
                    raise ValueError(f"\\S inside a set is not supported: {pattern!r}")
                out.append(f"[^{class_text('s')}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[" and not inside:
            inside = True
        elif ch == "]" and inside:
            inside = False
        elif ch == "(" and not inside and pattern[i + 1:i + 2] != "?":
            out.append("(?:")
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _gpt2_byte_to_unicode() -> dict:
    # printable latin-1 bytes stand for themselves; the rest are shifted to 256+ so every byte is a visible char
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, shift = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


BYTE_TO_UNICODE = _gpt2_byte_to_unicode()                         # byte value -> the char BPE vocabularies use
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
LATIN1_TO_GPT2 = str.maketrans({chr(b): c for b, c in BYTE_TO_UNICODE.items()})  # for str.translate on latin-1 text


if __name__ == "__main__":
    from pathlib import Path
    target = Path(__file__).with_name("_unicode_ranges.py")
    target.write_text(
        "# Generated by `python -m edgellm.tokenizer.unicode_classes`; do not edit.\n"
        "# llama.cpp's code point categories (UCD 15.1): 'start_hex:class' runs, each lasting until the next start.\n"
        "# Classes: L letter, N number, P punctuation, S symbol, M mark, Z separator, C control, U unassigned.\n"
        f"CATEGORY_RUNS = {compute_category_runs()!r}\n", encoding="utf-8")
    print(f"wrote {target}")
