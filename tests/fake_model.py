"""A scripted stand-in for a forward model, with a real byte-level BPE tokenizer, so API, CLI and server tests run
in milliseconds and know exactly which tokens come out.

`ScriptedDecoder.respond(prompt_ids, reply_ids)`: after exactly that prompt, the logits put a large peak on each
reply token in turn, then on EOS. For any other context the logits are fixed pseudo-random values keyed by the
last token, so sampling has a real distribution to work on. It keeps the KV-cache contract the API relies on
(n_past, reset, a cache whose n_past can be rewound) and counts the tokens it was fed.
"""
from types import SimpleNamespace

import numpy as np

from edgellm.api import Model
from edgellm.errors import ModelError
from edgellm.tokenizer import Tokenizer
from edgellm.tokenizer.unicode_classes import BYTE_TO_UNICODE

NORMAL, CONTROL = 1, 3
PIECES = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworld", "ĠS", "TO", "ĠSTO", "ĠSTOP"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor ld", "l d", "Ġ S", "T O", "ĠS TO",
          "ĠSTO P"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REPLY_PEAK = 30.0  # far above the noise (std 1): the scripted token wins greedy and sampled draws alike


def fake_metadata(**extra):
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + PIECES + ["ld"] + SPECIALS
    types = [NORMAL] * (len(tokens) - len(SPECIALS)) + [CONTROL] * len(SPECIALS)
    md = {"general.architecture": "llama", "general.name": "fake",
          "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array(types, np.int32), "tokenizer.ggml.merges": MERGES,
          "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
          "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
          "tokenizer.ggml.add_bos_token": False}
    md.update(extra)
    return md


class FakeCache:
    """Only what Model._rewind_cache reads: no layers, and an n_past that can be moved back."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.layers = []

    @property
    def n_past(self):
        return len(self._decoder.fed)

    @n_past.setter
    def n_past(self, n):
        del self._decoder.fed[n:]


class ScriptedDecoder:
    def __init__(self, n_vocab, eos_id, n_ctx=256, seed=0):
        self.n_vocab, self.n_ctx, self.n_threads, self.eos_id = n_vocab, n_ctx, 1, eos_id
        self.config = SimpleNamespace(n_vocab=n_vocab)
        self._noise = np.random.default_rng(seed).standard_normal((n_vocab, n_vocab)).astype(np.float32)
        self.fed = []
        self.cache = FakeCache(self)
        self.scripts = []  # (prompt ids, reply ids)
        self.tokens_fed = 0  # every token forward() processed, to check prefix reuse
        self.on_forward = None  # test hook, called before each forward

    @property
    def n_past(self):
        return len(self.fed)

    def respond(self, prompt_ids, reply_ids):
        self.scripts.append((list(prompt_ids), list(reply_ids)))

    def reset(self):
        self.fed = []

    def _next_logits(self):
        row = self._noise[self.fed[-1]].copy()
        for prompt, reply in self.scripts:
            if self.fed[:len(prompt)] == prompt and len(self.fed) >= len(prompt):
                k = len(self.fed) - len(prompt)
                if self.fed[len(prompt):] == reply[:k]:
                    row[reply[k] if k < len(reply) else self.eos_id] += REPLY_PEAK
                    break
        return row

    def forward(self, tokens, all_logits=False):
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if self.on_forward is not None:
            self.on_forward(tokens)
        if len(self.fed) + len(tokens) > self.n_ctx:
            raise ModelError(f"context full: {len(self.fed)} + {len(tokens)} > {self.n_ctx}")
        rows = []
        for t in tokens:
            self.fed.append(t)
            self.tokens_fed += 1
            rows.append(self._next_logits())
        out = np.stack(rows)
        return out if all_logits else out[-1:]


def fake_model(n_ctx=256, **metadata) -> Model:
    md = fake_metadata(**metadata)
    tok = Tokenizer.from_metadata(md)
    decoder = ScriptedDecoder(tok.n_vocab, tok.eos_id, n_ctx=n_ctx)
    return Model.from_parts(decoder, tok, md, path="/models/fake.gguf")


def script(model, prompt, reply_text=None, reply_ids=None):
    """Make `model` answer `prompt` (text or ids) with reply_text (tokenized) or exact reply_ids; returns the ids."""
    prompt_ids = model.tokenize(prompt, parse_special=True) if isinstance(prompt, str) else list(prompt)
    ids = reply_ids if reply_ids is not None else model.tokenize(reply_text, add_special=False)
    model.model.respond(prompt_ids, ids)
    return ids


def byte_ids(text: str):
    """One byte-level token per UTF-8 byte of text: splits every multi-byte character across tokens."""
    return [b for b in text.encode("utf-8")]  # byte b is token id b in fake_metadata's vocabulary
