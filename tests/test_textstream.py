"""Incremental UTF-8 assembly and stop strings: never half a character, never any part of a stop string."""
import random

import pytest

from edgellm.errors import SamplingError
from edgellm.generation.textstream import StopMatcher, TextStream

MIXED = "Hi 你好，世界! 😀👍🏽 naïve — ok"


def split_bytes(text, sizes):
    """text's UTF-8 bytes cut into consecutive pieces of the given sizes (the last piece takes the rest)."""
    data, pieces, i = text.encode("utf-8"), [], 0
    for n in sizes:
        pieces.append(data[i:i + n])
        i += n
    pieces.append(data[i:])
    return [p for p in pieces if p]


def run(stream, pieces, reason="length"):
    out = []
    for p in pieces:
        out.append(stream.push(p))
        if stream.stopped:
            return out
    out.append(stream.finish(reason))
    return out


def test_byte_by_byte_never_emits_half_a_character():
    data = MIXED.encode("utf-8")
    stream = TextStream()
    emitted = ""
    for b in data:
        piece = stream.push(bytes([b]))
        emitted += piece
        assert "\ufffd" not in piece
        assert MIXED.startswith(emitted)  # every step is a prefix of the real text: no garbage, no reordering
    emitted += stream.finish()
    assert emitted == MIXED == stream.text
    assert stream.finish_reason == "length"
    assert stream.n_tokens == len(data)


def test_four_byte_emoji_released_only_when_complete():
    stream = TextStream()
    emoji = "😀".encode("utf-8")
    assert [stream.push(emoji[i:i + 1]) for i in range(4)] == ["", "", "", "😀"]


@pytest.mark.parametrize("seed", range(5))
def test_random_token_boundaries(seed):
    rng = random.Random(seed)
    pieces = split_bytes(MIXED, [rng.randint(1, 5) for _ in range(40)])
    assert "".join(run(TextStream(), pieces)) == MIXED


def test_stop_string_split_across_tokens_is_never_emitted():
    stream = TextStream(stop=["world"])
    out = [stream.push(t.encode()) for t in ["Hello", " wor", "ld", "!!"]]
    assert out == ["Hello", " ", "", ""]  # "wor" was held back, then dropped with the match
    assert stream.stopped and stream.finish_reason == "stop"
    assert stream.stop_string == "world" and stream.stop_offset == len("Hello ") == len(stream.text)
    assert stream.finish("length") == "" and stream.finish_reason == "stop"


def test_multibyte_stop_string_byte_by_byte():
    text = "答案是四十二。然后更多"
    stream = TextStream(stop="。")
    emitted = "".join(run(stream, [bytes([b]) for b in text.encode()]))
    assert emitted == "答案是四十二"
    assert stream.finish_reason == "stop"


def test_held_prefix_released_when_text_diverges():
    stream = TextStream(stop=["abc"])
    assert stream.push(b"xab") == "x"
    assert stream.push(b"d") == "abd"
    assert stream.finish() == ""
    assert stream.text == "xabd" and stream.stop_string is None


def test_eos_flushes_held_text_with_reason_stop():
    stream = TextStream(stop=["###"])
    assert stream.push(b"a#") == "a"
    assert stream.push(b"#") == ""
    assert stream.finish("stop") == "##"
    assert stream.finish_reason == "stop" and stream.stop_string is None and stream.text == "a##"


def test_earliest_stop_wins_and_text_after_it_is_dropped():
    stream = TextStream(stop=["END", "\n\n"])
    assert "".join(run(stream, [b"one\n", b"\ntwo END"])) == "one"
    assert stream.stop_string == "\n\n"


def test_stop_inside_a_single_token_and_at_the_start():
    stream = TextStream(stop=["</s>"])
    assert stream.push(b"ok</s>trailing") == "ok"
    assert stream.stopped
    first = TextStream(stop=["User:"])
    assert first.push(b"User:") == "" and first.stop_offset == 0


def test_overlapping_stop_prefixes():
    # "aab" must be found though "aa" first looks like a failed start of it
    stream = TextStream(stop=["aab"])
    out = [stream.push(b) for b in (b"a", b"a", b"a", b"b")]
    assert "".join(out) == "a" and stream.stopped


def test_no_stops_passes_text_straight_through():
    stream = TextStream()
    assert stream.push(b"abc") == "abc"
    assert stream.finish() == ""


def test_after_stop_push_emits_nothing():
    stream = TextStream(stop="x")
    stream.push(b"1x2")
    assert stream.push(b"more") == "" and stream.text == "1"


def test_invalid_and_truncated_bytes():
    ignore = TextStream()
    assert ignore.push(b"a\xffb") == "ab"  # an invalid byte is dropped, as llama-cpp-python's errors="ignore"
    assert ignore.push("€".encode()[:2]) == ""
    assert ignore.finish() == ""  # a character cut off by the end of generation is dropped
    replace = TextStream(errors="replace")
    assert replace.push(b"a\xffb") == "a\ufffdb"
    replace.push("€".encode()[:2])
    assert replace.finish() == "\ufffd"


def test_stop_matcher_directly():
    m = StopMatcher(["stop", "halt"])
    assert m.feed("go st") == "go "
    assert m.feed("ha") == "st"  # "stha" cannot start "stop"; "ha" might start "halt"
    assert m.flush() == "ha"


@pytest.mark.parametrize("bad", [[""], [3], ""])
def test_invalid_stop_raises(bad):
    with pytest.raises(SamplingError, match="stop"):
        TextStream(stop=bad)


def test_invalid_finish_reason_raises():
    with pytest.raises(SamplingError, match="finish reason"):
        TextStream().finish("eos")
