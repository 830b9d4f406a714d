"""The GGUF reader's walk over a string array, compiled: where each element's 8-byte length sits.

A vocabulary's elements can only be found one after another (each length says where the next one starts), which
in Python costs about half a microsecond an element: 40-50 ms for SmolLM2's tokens and merges, over 100 ms for
Gemma 3's 262,144 tokens. Compiled, the same walk takes well under a millisecond. The reader uses it only when
Numba is already imported (a model load); a header read from a tool keeps its light imports and the Python walk.

The walk here only succeeds or gives up: on anything wrong (a length past the file's end, a truncated element) it
returns -1 and the reader walks the array again in Python, which says what is wrong and where, so both paths
raise the same errors.
"""
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _length_at(buf, pos):
    n = np.uint64(0)
    for k in range(8):
        n |= np.uint64(buf[pos + k]) << np.uint64(8 * k)
    return n


@njit(cache=True, nogil=True)
def string_array_offsets(buf, pos, count, limit):
    """int64 [count + 1]: where each of the `count` strings from `pos` has its length, then the array's end, every
    element within buf[:limit]; an empty array if it is not so. Walked twice, so that nothing is allocated before
    the count is known to be real."""
    start = pos
    for _ in range(count):
        if pos + 8 > limit:
            return np.empty(0, np.int64)
        n = _length_at(buf, pos)
        pos += 8
        if n > np.uint64(limit - pos):
            return np.empty(0, np.int64)
        pos += np.int64(n)
    out = np.empty(count + 1, np.int64)
    pos = start
    for i in range(count):
        out[i] = pos
        pos += 8 + np.int64(_length_at(buf, pos))
    out[count] = pos
    return out


def walk(buf, pos: int, count: int, limit: int):
    """The offsets of a string array's elements and its end (uint32 where the end is below 4 GiB, else int64), or
    None where the array is not well formed within buf[:limit]."""
    out = string_array_offsets(np.frombuffer(buf, np.uint8, count=limit), pos, count, limit)
    if len(out) != count + 1:
        return None
    return out.astype(np.uint32) if out[-1] < 1 << 32 else out
