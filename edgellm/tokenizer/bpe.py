"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) as llama.cpp's llm_tokenizer_bpe_session does it.

Text is split by the pre-tokenizer, each word's UTF-8 bytes are mapped to GPT-2's printable byte characters, and
within a word the adjacent pair with the lowest merge rank is merged first (leftmost on ties), one pair at a time,
with a priority queue. Results are cached per word, so text made of already-seen words costs a dict lookup each.
"""
import heapq

from .pretokenize import PreTokenizer, pre_type_settings
from .strings import TextIndex
from .unicode_classes import LATIN1_TO_GPT2
from .wordcache import WordCache



class BPEModel:
    def __init__(self, vocab, merges):
        self._token_to_id = vocab.token_to_id
        chain, self._ignore_merges, _ = pre_type_settings(vocab.pre)
        self._pre = PreTokenizer(chain)
        # rank of "left right" (the merge's index; llama.cpp keeps the first of duplicate merges). Byte-encoded
        # symbols never contain a raw space, so the joined text identifies the pair. A TextIndex, not a dict: the
        # merges stay in the file's map (SmolLM2's 48,900 would be ~7 MiB of str and dict).
        # Built on the first word encoded: hashing every merge is work a load does not need.
        self._merges, self._rank_index = merges, None
        self._cache = WordCache()

    @property
    def _ranks(self) -> TextIndex:
        if self._rank_index is None:
            self._rank_index = TextIndex(self._merges, unique=False, what="tokenizer.ggml.merges")
        return self._rank_index

    def encode(self, text: str) -> list:
        cache = self._cache
        out = []
        for word in self._pre.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word.encode("utf-8").decode("latin-1").translate(LATIN1_TO_GPT2))
                cache.put(word, ids)
            out += ids
        return out

    def _encode_word(self, word: str) -> list:
        lookup = self._token_to_id.get
        if self._ignore_merges:
            token_id = lookup(word)
            if token_id is not None:
                return [token_id]
        symbols = list(word)         # symbols[i]: text of the symbol starting at char i ('' once merged away)
        n = len(symbols)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        ranks = self._ranks
        queue = []
        for i in range(n - 1):
            rank = ranks.get(symbols[i] + " " + symbols[i + 1])
            if rank is not None:
                queue.append((rank, i, i + 1, symbols[i] + symbols[i + 1]))
        heapq.heapify(queue)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue             # stale: one side was merged into something else since this pair was queued
            symbols[left], symbols[right] = merged, ""
            nxt[left] = after = nxt[right]
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                rank = ranks.get(symbols[before] + " " + merged)
                if rank is not None:
                    heapq.heappush(queue, (rank, before, left, symbols[before] + merged))
            if after >= 0:
                rank = ranks.get(merged + " " + symbols[after])
                if rank is not None:
                    heapq.heappush(queue, (rank, left, after, merged + symbols[after]))
        out = []
        for sym in symbols:
            if not sym:
                continue
            token_id = lookup(sym)
            if token_id is not None:
                out.append(token_id)
            else:
                # llama.cpp looks up each byte of the symbol's UTF-8 text as a one-byte token; only ASCII can hit
                out += [lookup(chr(b)) for b in sym.encode("utf-8") if b < 0x80 and lookup(chr(b)) is not None]
        return out
