"""BPE pre-tokenizers: `tokenizer.ggml.pre` -> the chain of regexes llama.cpp splits text with (llama-vocab.cpp).

Each regex of a chain is applied to every piece the previous one produced; matches and the unmatched gaps between
them both become pieces (llama.cpp's unicode_regex_split). The patterns are llama.cpp's, rewritten for Python `re`
by `translate_pattern` with llama.cpp's own Unicode categories, so no third-party `regex` module is needed. For the
patterns llama.cpp runs through hand-written splitters (gpt2, llama3, qwen2) the rewritten regex gives the same
pieces; tests/test_tokenizer_pretokenize.py checks that against a direct port of those splitters.
"""
import functools
import re

from ..errors import TokenizerError
from .unicode_classes import collapse_astral, translate_pattern

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's gpt2 splitter falls back to \s+ for a lone whitespace before a non-space, hence the trailing |\s+.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss): llama.cpp's form of the case-aware letter runs, a capital run then a lower-case run with a
# contraction attached (its groups made non-capturing: the splitter takes whole matches).
_UPPER_RUN, _LOWER_RUN = r"(?:(?=[\p{L}])[^a-z])", r"(?:(?=[\p{L}])[^A-Z])"
GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "*" + _LOWER_RUN + "+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "+" + _LOWER_RUN + "*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MINICPM5 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# pre-type name -> (regex chain, ignore_merges, add_bos default). Names as llama.cpp's llama_vocab::impl::load.
_PRE_TYPES = {}


def _register(names, chain, ignore_merges=False, add_bos=False):
    for name in names:
        _PRE_TYPES[name] = (tuple(chain), ignore_merges, add_bos)


_register(["default"], [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
_register(["gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
           "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
           "trillion", "granite-docling", "exaone4"], [GPT2])
_register(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
           "jina-v5-nano"], [LLAMA3], ignore_merges=True, add_bos=True)
_register(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], [LLAMA3])
_register(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
          [r"\p{N}", GPT2])
_register(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
           "grok-2"], [QWEN2])
_register(["qwen35"], [QWEN35])
_register(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], [GPT4O])
_register(["minicpm5"], [r"\p{N}{1,3}", MINICPM5], ignore_merges=True)
_register(["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"])


def pre_type_settings(pre: str):
    """(regex chain, ignore_merges, add_bos default) for a `tokenizer.ggml.pre` value ('' means 'default')."""
    try:
        return _PRE_TYPES[pre or "default"]
    except KeyError:
        raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r}; known: {sorted(_PRE_TYPES)}") from None


@functools.lru_cache(maxsize=None)
def _compiled(pattern: str):
    return re.compile(translate_pattern(pattern))


class PreTokenizer:
    """Splits text into the words BPE merges within."""

    def __init__(self, chain):
        self._chain = tuple(chain)
        self._compiled = None   # compiled on the first split: ~0.1 s of re's work a load needs for no token

    @property
    def _regexes(self) -> list:
        if self._compiled is None:
            self._compiled = [_compiled(p) for p in self._chain]
        return self._compiled

    def split(self, text: str) -> list:
        if text and max(text) > "\uffff":
            pieces, pos = [], 0
            for piece in self._split(collapse_astral(text)):
                pieces.append(text[pos:pos + len(piece)])
                pos += len(piece)
            return pieces
        return self._split(text)

    def _split(self, text: str) -> list:
        pieces = [text]
        for rx in self._regexes:
            out = []
            for piece in pieces:
                words = rx.findall(piece)
                if sum(map(len, words)) == len(piece):    # the regex covered everything: no gaps to keep
                    out += words
                    continue
                pos = 0
                for m in rx.finditer(piece):
                    start, end = m.span()
                    if start > pos:
                        out.append(piece[pos:start])
                    if end > start:
                        out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces
