"""`edgellm chat` driven through a pseudo-terminal on SmolLM2: two turns with history, /reset, /system, Ctrl-C in
the middle of a reply (the chat goes on and the model still answers as before), /exit."""
import os
import pty
import re
import select
import signal
import sys
import time

import pytest

TURN_TIMEOUT_S = 240  # a reply of <= 24 tokens plus the model load, on a slow shared CI machine
PROMPT = "> "
STATS = re.compile(r"\[prompt (\d+) tokens \| reply (\d+) tokens")


class Terminal:
    """A child process on a pty: send keystrokes, wait for output matching a pattern."""

    def __init__(self, argv, env, ignore_sigint=False):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the pty is its controlling terminal, so \x03 becomes SIGINT
            try:
                if ignore_sigint:  # as a background job of a non-interactive shell starts: SIGINT ignored
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.buffer = ""
        self.closed = False
        self.reaped = False
        self.pos = 0  # output before this index has been matched already

    def read_some(self, timeout):
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        self.closed = not data
        self.buffer += data.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def expect(self, pattern, timeout=TURN_TIMEOUT_S):
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.buffer, self.pos)
            if match:
                self.pos = match.end()
                return match
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                why = "timed out" if left <= 0 else "the terminal closed"
                raise AssertionError(f"{why} waiting for {pattern!r}; output so far:\n{self.buffer}")
            self.read_some(left)

    def send(self, text):
        os.write(self.fd, text.encode("utf-8"))

    def turn(self, line):
        """Send a line; return (reply text, prompt tokens) once the stats line and the next prompt arrived."""
        self.send(line + "\r")
        self.expect(re.escape(line) + "\n")  # the terminal's echo of what was typed
        start = self.pos
        stats = self.expect(STATS.pattern)
        reply = self.buffer[start:stats.start()].strip()
        self.expect(PROMPT)
        return reply, int(stats.group(1))

    def wait_exit(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.reaped = True
                return os.waitstatus_to_exitcode(status)
            self.read_some(0.2)
        os.kill(self.pid, 9)
        raise AssertionError("edgellm chat did not exit")


def _start_chat(path, ignore_sigint=False):
    env = dict(os.environ, TERM="dumb", PYTHONIOENCODING="utf-8")
    return Terminal([sys.executable, "-m", "edgellm.cli", "chat", path, "-n", "24", "-c", "1024", "--show-stats"],
                    env, ignore_sigint=ignore_sigint)


def _stop(term):
    if not term.reaped:
        os.kill(term.pid, 9)
        os.waitpid(term.pid, 0)
    os.close(term.fd)


@pytest.fixture
def chat(smollm2_path):
    term = _start_chat(smollm2_path)
    yield term
    _stop(term)


@pytest.fixture
def chat_sigint_ignored(smollm2_path):
    term = _start_chat(smollm2_path, ignore_sigint=True)
    yield term
    _stop(term)


def test_chat_turns_reset_interrupt_and_exit(chat):
    chat.expect("edgellm chat: .*/reset")
    chat.expect(PROMPT)
    first, tokens_first = chat.turn("What is 2+2?")
    assert first
    second, tokens_second = chat.turn("And 3+3?")
    assert tokens_second > tokens_first + 5  # the first exchange is in the second prompt: history is kept

    chat.send("/reset\r")
    chat.expect(r"\(conversation cleared\)")
    chat.expect(PROMPT)
    again, tokens_again = chat.turn("What is 2+2?")
    assert (again, tokens_again) == (first, tokens_first)  # greedy, from a fresh conversation

    # Ctrl-C once the reply has started: the reply stops, the chat stays
    chat.send("Write a very long poem about the sea, with many verses.\r")
    chat.expect(r"many verses\.\n")
    chat.expect(r"\S")  # the first piece of the reply
    chat.send("\x03")
    chat.expect(r"\[interrupted\]")
    chat.expect(PROMPT)
    chat.send("/reset\r")
    chat.expect(r"\(conversation cleared\)")
    chat.expect(PROMPT)
    assert chat.turn("What is 2+2?") == (first, tokens_first)  # the model is intact after the interrupt

    chat.send("/system You are a pirate.\r")
    chat.expect(r"system prompt set")
    chat.expect(PROMPT)
    chat.send("/exit\r")
    assert chat.wait_exit() == 0


def test_ctrl_c_stops_a_reply_when_started_with_sigint_ignored(chat_sigint_ignored):
    """A chat launched as a background job of a script inherits SIGINT ignored; Ctrl-C must still stop a reply."""
    chat = chat_sigint_ignored
    chat.expect(PROMPT)
    chat.send("Write a very long poem about the sea, with many verses.\r")
    chat.expect(r"many verses\.\n")
    chat.expect(r"\S")
    chat.send("\x03")
    chat.expect(r"\[interrupted\]", timeout=60)
    chat.expect(PROMPT)
    chat.send("/exit\r")
    assert chat.wait_exit() == 0
