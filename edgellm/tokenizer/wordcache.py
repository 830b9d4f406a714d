"""The per-word tokenization cache shared by the BPE and SentencePiece models, bounded by its size in bytes.

Natural text repeats a small set of short words, so caching them makes encoding a dict lookup per word. A long
word (a run of digits, base64, one character repeated) is rarely seen twice and would pin its whole text and id
list, so words past a length are never cached; the cache is dropped whole once its estimated size passes the
budget, which costs only re-tokenizing the words that come back.
"""

MAX_WORD_CHARS = 256           # longer words are tokenized every time
BUDGET_BYTES = 32 * 1024 * 1024  # per model; a typical English word costs ~250 bytes, so ~130k words
_ENTRY_OVERHEAD = 160          # dict slot, the list object and the str header, approximately
_ID_BYTES = 36                 # a list slot and a small int object (ids above 256 are not interned)


class WordCache:
    def __init__(self, budget_bytes: int = BUDGET_BYTES, max_word_chars: int = MAX_WORD_CHARS):
        self.budget_bytes = budget_bytes
        self.max_word_chars = max_word_chars
        self.nbytes = 0
        self._entries = {}

    def get(self, word):
        return self._entries.get(word)

    def put(self, word: str, ids: list) -> None:
        if len(word) > self.max_word_chars:
            return
        cost = _ENTRY_OVERHEAD + len(word) * (4 if not word.isascii() else 1) + _ID_BYTES * len(ids)
        if self.nbytes + cost > self.budget_bytes:
            self._entries.clear()
            self.nbytes = 0
        self._entries[word] = ids
        self.nbytes += cost

    def __contains__(self, word) -> bool:
        return word in self._entries

    def __len__(self) -> int:
        return len(self._entries)
