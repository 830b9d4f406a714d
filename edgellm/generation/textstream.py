"""Incremental detokenization with stop strings.

Token bytes arrive one token at a time (`tokenizer.token_to_bytes(id)`); a character can be split across tokens
(byte-fallback tokens, byte-level BPE), so an incremental UTF-8 decoder turns bytes into text only once each
character is complete. The text then passes a stop-string matcher that never emits any part of a stop string: it
holds back the longest tail that could still grow into one, across token boundaries, and on a match drops the stop
string and everything after it.

    stream = TextStream(stop=["\\n\\n"])
    for token in tokens:
        if tokenizer.is_eog(token):
            out += stream.finish("stop"); break
        out += stream.push(tokenizer.token_to_bytes(token))
        if stream.stopped:                     # a stop string: finish_reason is "stop"
            break
    else:
        out += stream.finish("length")
"""
from __future__ import annotations

import codecs
from typing import Iterable

from edgellm.errors import SamplingError

FINISH_REASONS = ("stop", "length")


def _as_stop_list(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop)
    for s in stops:
        if not isinstance(s, str) or s == "":
            raise SamplingError(f"stop must be a non-empty string or a list of them, got {s!r}")
    return stops


class StopMatcher:
    """Finds stop strings in text fed piece by piece; holds back text that may be the start of one."""

    def __init__(self, stop: str | Iterable[str] | None = ()):
        self.stops = _as_stop_list(stop)
        self.held = ""  # text received but not yet released
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what is now safe to emit. After a match, returns the text before it and drops the rest."""
        if self.matched is not None:
            return ""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        # the earliest occurrence of any stop string; at equal positions the first in the list
        best_pos, best = -1, None
        for s in self.stops:
            pos = self.held.find(s)
            if pos >= 0 and (best is None or pos < best_pos):
                best_pos, best = pos, s
        if best is not None:
            self.matched = best
            out, self.held = self.held[:best_pos], ""
            return out
        hold = self._partial_match_length()
        cut = len(self.held) - hold
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def _partial_match_length(self) -> int:
        """Length of the longest tail of held text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), longest, -1):
                if self.held.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Release held text (the stream ended without completing a stop string)."""
        if self.matched is not None:
            return ""
        out, self.held = self.held, ""
        return out


class TextStream:
    """Token bytes in, text pieces out: whole UTF-8 characters only, stop strings never emitted."""

    def __init__(self, stop: str | Iterable[str] | None = (), errors: str = "ignore"):
        # "ignore" drops invalid bytes, as llama-cpp-python's decode(errors="ignore") does; "replace" gives U+FFFD
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
        self._matcher = StopMatcher(stop)
        self.text = ""  # everything emitted so far
        self.finish_reason: str | None = None
        self.n_tokens = 0
        # characters out of the UTF-8 decoder so far, stop strings included: where the next token's text begins
        self.decoded_chars = 0

    @property
    def stopped(self) -> bool:
        """True once a stop string matched (or finish() was called); push() then emits nothing more."""
        return self.finish_reason is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._matcher.matched

    @property
    def stop_offset(self) -> int | None:
        """Character offset in `text` where the stop string began (== len(text)), if one ended the stream."""
        return len(self.text) if self._matcher.matched is not None else None

    def push(self, token_bytes: bytes) -> str:
        """Add one token's bytes; return the text that can be shown now (often '', never half a character)."""
        if self.stopped:
            return ""
        self.n_tokens += 1
        decoded = self._decoder.decode(bytes(token_bytes), final=False)
        self.decoded_chars += len(decoded)
        piece = self._matcher.feed(decoded)
        if self._matcher.matched is not None:
            self.finish_reason = "stop"
        self.text += piece
        return piece

    def finish(self, reason: str = "length") -> str:
        """End the stream: "stop" for an end-of-generation token, "length" for max_tokens. Returns held-back text.

        After a stop string has matched, returns '' and keeps finish_reason "stop".
        """
        if reason not in FINISH_REASONS:
            raise SamplingError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if self.stopped:
            return ""
        # bytes of an unfinished character are decoded under `errors` (dropped by default)
        decoded = self._decoder.decode(b"", final=True)
        self.decoded_chars += len(decoded)
        tail = self._matcher.feed(decoded)
        if self._matcher.matched is not None:
            self.finish_reason = "stop"
        else:
            tail += self._matcher.flush()
            self.finish_reason = reason
        self.text += tail
        return tail
