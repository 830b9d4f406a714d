"""SentencePiece-style BPE (`tokenizer.ggml.model = llama`) as llama.cpp's llm_tokenizer_spm_session does it.

Spaces become U+2581 (▁); starting from single characters, the adjacent pair whose concatenation is a vocabulary
token with the highest score is merged first (leftmost on ties). Characters left without a token fall back to
<0xNN> byte tokens.

Speed: a merge can only join two symbols if some vocabulary token contains their junction. Where a ▁ follows a
character c and no token contains "c▁", no merge can ever cross that point, so the text is cut there into words
that are tokenized independently (the merge order within each word is unchanged) and cached. For Gemma 3 only
'>' precedes ▁ inside a token ('>▁</'), so nearly every word boundary qualifies.
"""
import heapq
import re

import numpy as np

from ..errors import TokenizerError
from .strings import StringTable
from .wordcache import WordCache

SPACE = "\u2581"


def _chars_before_space(tokens) -> set:
    """The characters that precede a ▁ inside some token (a ▁ at a token's start joins nothing). Only the tokens
    with such a ▁ are decoded: in a StringTable they are found in the bytes, for Gemma 3 a few hundred of 262k."""
    if isinstance(tokens, StringTable):
        candidates = tokens.ids_containing(SPACE, after_start=True)
    else:
        candidates = range(len(tokens))
    chars = set()
    for i in candidates:
        text = tokens[i]
        at = text.find(SPACE, 1)
        while at > 0:
            chars.add(text[at - 1])
            at = text.find(SPACE, at + 1)
    return chars


class SPMModel:
    def __init__(self, vocab):
        self._token_to_id = vocab.token_to_id
        # float32 values that index as Python floats, as tolist() would give, with no copy of the 1 MB (262k tokens)
        self._scores = memoryview(np.ascontiguousarray(vocab.scores, "=f4"))
        # characters that some token joins to a following ▁: word cuts must not go after them
        blocked = "".join(re.escape(c) for c in sorted(_chars_before_space(vocab.tokens) | {SPACE}))
        self._cut = re.compile(f"(?<=[^{blocked}])(?={SPACE})")
        self._byte_ids = [self._byte_token(vocab.token_to_id, b) for b in range(256)]
        self._cache = WordCache()

    @staticmethod
    def _byte_token(token_to_id, byte):
        token_id = token_to_id.get(f"<0x{byte:02X}>")
        if token_id is None and byte < 0x80:
            token_id = token_to_id.get(chr(byte))
        return token_id

    def encode(self, text: str) -> list:
        """Tokenize one raw fragment (spaces already escaped to ▁ by the caller)."""
        cache = self._cache
        out = []
        for word in self._cut.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                cache.put(word, ids)
            out += ids
        return out

    def _encode_word(self, word: str) -> list:
        if not word:
            return []
        lookup = self._token_to_id.get
        scores = self._scores
        n = len(word)
        sizes = [1] * n              # symbol starting at char i spans word[i:i + sizes[i]]; 0 once merged away
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        queue = []
        for i in range(n - 1):
            token_id = lookup(word[i:i + 2])
            if token_id is not None:
                queue.append((-scores[token_id], i, i + 1, 2))
        heapq.heapify(queue)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not sizes[left] or not sizes[right] or sizes[left] + sizes[right] != size:
                continue             # stale pair
            sizes[left], sizes[right] = size, 0
            nxt[left] = after = nxt[right]
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                token_id = lookup(word[before:left + size])
                if token_id is not None:
                    heapq.heappush(queue, (-scores[token_id], before, left, sizes[before] + size))
            if after >= 0:
                token_id = lookup(word[left:after + sizes[after]])
                if token_id is not None:
                    heapq.heappush(queue, (-scores[token_id], left, after, size + sizes[after]))
        out = []
        i = 0
        while i >= 0:
            piece = word[i:i + sizes[i]]
            token_id = lookup(piece)
            if token_id is not None:
                out.append(token_id)
            else:                    # an unmerged character outside the vocabulary: one token per UTF-8 byte
                for b in piece.encode("utf-8"):
                    byte_id = self._byte_ids[b]
                    if byte_id is None:
                        raise TokenizerError(f"no byte-fallback token for byte 0x{b:02X} (character {piece!r})")
                    out.append(byte_id)
            i = nxt[i]
        return out
