"""Vocabulary texts and merges kept in the GGUF file's memory map rather than as Python objects.

As list[str] plus a dict text -> id, Gemma 3's 262k tokens cost ~35 MiB of small objects for the life of the model.
Here `StringTable` decodes entry i from the map when it is read, and `TextIndex` finds the id of a text with an
open-addressing hash table: 2 to 4 slots an entry, each an int32 id and a uint16 tag (3 MiB for Gemma), built
with numpy and one hash() per entry.

The key of an entry is Python's hash() of its decoded text, and a candidate is confirmed by comparing decoded text,
so an index answers exactly as a dict keyed by the decoded strings did (two byte strings that decode, with
errors="replace", to the same text are one key). hash() of a str is salted per process; an index is built and
probed in the same one. A lookup is Python, several times a dict's time; the
BPE and SPM word caches keep it off text made of words already seen.
"""
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import TokenizerError

_HASH_CHUNK = 4096                        # entries decoded (as one joined string) and hashed at a time
_SEPARATORS = bytes(range(32)) + b"\x7f"   # tried in turn to join a chunk: the first byte no entry contains


class StringTable(Sequence):
    """Read-only sequence of str: entry i is buffer[offsets[i] + gap : offsets[i + 1]] decoded as UTF-8 with
    errors="replace", as the GGUF reader's to_list() gives it (gap skips the 8-byte lengths of a GGUF string array).
    With name_empty, an empty entry reads "[EMPTY_i]", as llama.cpp renames empty vocabulary entries."""

    def __init__(self, buffer, offsets, gap: int = 0, name_empty: bool = False, what: str = "string array"):
        self._view = np.frombuffer(buffer, np.uint8)   # also keeps a memory map open while the table uses it
        offsets = np.ascontiguousarray(offsets)
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 1:
            raise TokenizerError(f"{what}: offsets must be a 1-D integer array, got {offsets.dtype} {offsets.shape}")
        if (offsets[0] < 0 or offsets[-1] > len(self._view)
                or np.any(offsets[1:].astype(np.int64) - offsets[:-1] < gap)):
            raise TokenizerError(f"{what}: string offsets out of order or outside the {len(self._view)}-byte buffer")
        self.buffer, self.offsets, self.gap, self.what = buffer, offsets, gap, what
        self._n = len(offsets) - 1
        self._name_empty = name_empty
        self._bounds = memoryview(offsets)   # indexes as Python ints, several times faster than numpy scalars

    def __len__(self) -> int:
        return self._n

    def _text(self, i: int) -> str:
        start, end = self._bounds[i] + self.gap, self._bounds[i + 1]
        if start == end and self._name_empty:
            return f"[EMPTY_{i}]"
        return self.buffer[start:end].decode("utf-8", "replace")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._text(j) for j in range(*i.indices(self._n))]
        j = i.__index__()
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"{self.what} index {i} out of range [0, {self._n})")
        return self._text(j)

    def __iter__(self):
        return map(self._text, range(self._n))

    def lengths(self) -> np.ndarray:
        """Byte length of every entry as stored (0 for an empty one, whatever name it reads as)."""
        return (self.offsets[1:].astype(np.int64) - self.offsets[:-1]) - self.gap

    def named(self) -> dict:
        """{"[EMPTY_i]": i} for the empty entries that read as a name (none without name_empty)."""
        if not self._name_empty:
            return {}
        return {self._text(i): i for i in np.flatnonzero(self.lengths() == 0).tolist()}

    def hashes(self) -> np.ndarray:
        """hash() of every entry's text (int64), without a str per entry at any time: a chunk of entries is
        joined with a byte none of them contains, decoded once and split, and each piece is hashed and dropped.
        (An ASCII joint cannot change how its neighbours decode: errors="replace" never takes an ASCII byte into
        a replaced sequence.)"""
        out = np.empty(self._n, np.int64)
        offsets, gap = self.offsets.astype(np.int64), self.gap
        for a in range(0, self._n, _HASH_CHUNK):
            b = min(a + _HASH_CHUNK, self._n)
            lo, hi = int(offsets[a]), int(offsets[b])
            text = np.ones(hi - lo, bool)                    # the region's bytes that are entries' text
            for k in range(gap):
                text[offsets[a:b] - lo + k] = False
            lengths = offsets[a + 1:b + 1] - offsets[a:b] - gap
            joints = np.cumsum(lengths + 1) - lengths - 1    # a joint before each entry
            joined = np.empty(len(joints) + int(lengths.sum()), np.uint8)
            is_joint = np.zeros(len(joined), bool)
            is_joint[joints] = True
            joined[~is_joint] = self._view[lo:hi][text]
            for sep in _SEPARATORS:
                joined[joints] = sep
                if np.count_nonzero(joined == sep) == len(joints):     # only at the joints
                    pieces = joined.tobytes().decode("utf-8", "replace").split(chr(sep))
                    if len(pieces) == len(joints) + 1:
                        out[a:b] = np.fromiter(map(hash, pieces[1:]), np.int64, b - a)
                        break
            else:                                                       # every separator occurs: one by one
                out[a:b] = np.fromiter(map(hash, map(self._text, range(a, b))), np.int64, b - a)
        if self._name_empty:
            for text, i in self.named().items():
                out[i] = hash(text)
        return out

    def ids_containing(self, text: str, after_start: bool = False) -> list:
        """Ids of the entries whose text contains `text` (with after_start: somewhere past its first character),
        found in the bytes with numpy instead of decoding every entry. An occurrence in the bytes is one in the
        text: errors="replace" never takes a complete UTF-8 sequence into a replaced one, and the bytes before an
        occurrence, if any, decode to at least one character."""
        skip = 1 if after_start else 0
        pattern = np.frombuffer(text.encode("utf-8"), np.uint8)
        lo, hi = int(self.offsets[0]), int(self.offsets[-1])
        if not len(pattern):
            return [i for i in range(self._n) if len(self._text(i)) >= skip]
        found = [i for name, i in self.named().items() if text in name[skip:]]
        if hi - lo >= len(pattern):
            region = self._view[lo:hi]
            span = len(region) - len(pattern) + 1
            hit = region[:span] == pattern[0]
            for k in range(1, len(pattern)):
                hit &= region[k:k + span] == pattern[k]
            at = np.flatnonzero(hit) + lo
            ids = np.searchsorted(self.offsets, at, side="right") - 1
            starts = self.offsets[ids].astype(np.int64) + self.gap
            inside = (at >= starts + skip) & (at + len(pattern) <= self.offsets[ids + 1])
            found += ids[inside].tolist()
        return sorted(set(found))


def _tags(hashes: np.ndarray) -> np.ndarray:
    """A slot's tag: the top 16 bits of its entry's hash, 0 read as 1 (0 marks an empty slot)."""
    tags = (hashes >> 48).astype(np.uint16)
    tags[tags == 0] = 1
    return tags


class TextIndex(Mapping):
    """text -> id over a sequence of texts (a list, or a StringTable whose texts stay in the map): the first id of
    each text. unique=True refuses duplicates (vocabulary texts) with a TokenizerError; unique=False keeps the first
    of equal texts, as llama.cpp does with duplicate BPE merges.

    Layout: linear probing over 2 to 4 slots an entry, each an int32 id and a uint16 tag (16 more bits of the hash;
    0 marks an empty slot), so a probe passes over other entries, and stops at an empty slot, on one read. The slots
    run past the last home slot (no wrap-around) and end empty. They are filled without a Python loop: entries
    sorted by home slot take positions k + max(home_j - j for j <= k), so every slot from an entry's home to its
    position is occupied, which is all a probe relies on."""

    def __init__(self, texts, unique: bool, what: str):
        n = len(texts)
        table_source = isinstance(texts, StringTable)
        if table_source:
            hashes, text_of, extra = texts.hashes(), texts._text, texts.named()
        else:
            hashes, text_of, extra = np.fromiter(map(hash, texts), np.int64, n), texts.__getitem__, {}
        bits = max(2 * n - 1, 1).bit_length()  # 2 to 4 slots an entry: < 2.5 probes for a miss, < 1.5 for a hit
        mask = (1 << bits) - 1
        ids = self._dedup(hashes, bits, unique, what, text_of)
        self._n = len(ids)
        if extra:                              # named empty entries are found by name, not by their bytes
            ids = ids[~np.isin(ids, list(extra.values()))]
        homes = hashes[ids] & mask
        steps = np.arange(len(ids), dtype=np.int64)
        positions = steps + np.maximum.accumulate(homes - steps)
        size = max(mask, int(positions[-1]) if len(ids) else 0) + 2
        id_at = np.full(size, -1, np.int32)
        id_at[positions] = ids
        tag_at = np.zeros(size, np.uint16)
        tag_at[positions] = _tags(hashes[ids])
        self._texts, self._id_at, self._tag_at = texts, id_at, tag_at
        id_at, tag_at = memoryview(id_at), memoryview(tag_at)

        if table_source:
            buf, bounds, gap = texts.buffer, memoryview(texts.offsets), texts.gap

            def get(text, default=None):
                h = hash(text)
                slot = h & mask
                tag = (h >> 48) & 0xFFFF or 1
                t = tag_at[slot]
                while t:
                    if t == tag:
                        i = id_at[slot]
                        if buf[bounds[i] + gap:bounds[i + 1]].decode("utf-8", "replace") == text:
                            return i
                    slot += 1
                    t = tag_at[slot]
                return extra.get(text, default) if extra else default
        else:
            def get(text, default=None):
                h = hash(text)
                slot = h & mask
                tag = (h >> 48) & 0xFFFF or 1
                t = tag_at[slot]
                while t:
                    if t == tag:
                        i = id_at[slot]
                        if texts[i] == text:
                            return i
                    slot += 1
                    t = tag_at[slot]
                return default

        self.get = get

    @staticmethod
    def _dedup(hashes, bits, unique, what, text_of) -> np.ndarray:
        """Entry ids sorted by home slot (the low `bits` of the hash), less later duplicates. Equal texts have equal
        hashes, so only runs of equal hashes are compared: duplicates, and the ~1 in 250 of Gemma's entries whose
        str hash equals another's (CPython hashes a str's code units, so '弧' (0x5F27) hashes as "'_")."""
        h = hashes.view(np.uint64)
        key = (h >> np.uint64(bits)) | (h << np.uint64(64 - bits))   # rotated: the home slot sorts first
        order = np.argsort(key, kind="stable")
        key = key[order]
        same = np.flatnonzero(key[1:] == key[:-1])
        if not len(same):
            return order.astype(np.int32)
        keep = np.ones(len(order), bool)
        for start in same[np.r_[True, np.diff(same) > 1]].tolist():
            end = start + 1
            while end < len(key) and key[end] == key[start]:
                end += 1
            first = {}
            for k in range(start, end):        # ids ascending: the sort is stable
                i = int(order[k])
                text = text_of(i)
                if text not in first:
                    first[text] = i
                elif unique:
                    raise TokenizerError(f"duplicate token text in {what}: {text[:40]!r} at ids {first[text]} and {i}")
                else:
                    keep[k] = False
        return order[keep].astype(np.int32)

    def __getitem__(self, text):
        i = self.get(text)
        if i is None:
            raise KeyError(text)
        return i

    def __contains__(self, text) -> bool:
        return self.get(text) is not None

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        """The indexed texts in id order (the first of duplicates only), as a dict filled in id order iterates."""
        ids = self._id_at[self._id_at >= 0].tolist()
        if isinstance(self._texts, StringTable):
            ids += self._texts.named().values()
        return map(self._texts.__getitem__, sorted(ids))

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (the texts are not counted)."""
        return self._id_at.nbytes + self._tag_at.nbytes
