"""Speculative decoding on both real models: greedy output with prompt lookup is plain greedy decoding's, token for
token and logits for logits (each verified row has a decode step's bits), on input-grounded prompts where drafts
are accepted; on Gemma-3 also past the wrap of its sliding-window rings, where rolled-back rows overwrote slots."""
import numpy as np
import pytest
from conftest import GEMMA, SMOLLM2

import edgellm
from edgellm.api import Model
from edgellm.engine import gguf as gguf_reader
from edgellm.engine.models import build_model
from edgellm.generation.speculative import DraftLength
from edgellm.prep.speculative_bench import CODE, PASSAGE
from edgellm.tokenizer import Tokenizer

N_GEN = 32
RING_BATCH = 32  # Gemma's rings hold window + 31 slots (rounded to 32): 544 for its 512-token window


def _run(m, ids, **kw):
    seen = []
    c = m.complete(ids, max_tokens=N_GEN, ignore_eos=True,
                   logits_processor=lambda h, s: (seen.append(s.copy()), s)[1], **kw)
    return c, seen


def _check_same(m, ids):
    m.reset()
    plain = _run(m, ids, speculative=None)
    m.reset()
    spec = _run(m, ids, speculative="lookup")
    assert spec[0].tokens == plain[0].tokens
    assert all(np.array_equal(a, b) for a, b in zip(spec[1], plain[1])), "a step's logits differ"
    return spec[0]


@pytest.mark.parametrize("name", [SMOLLM2, GEMMA])
def test_lookup_greedy_equals_plain_greedy(name, monkeypatch):
    # the draft length follows timed verification costs; a fixed cost keeps the drafts (and the count) repeatable
    monkeypatch.setattr(DraftLength, "timed_verification", lambda self, rows, seconds: None)
    m = edgellm.load(name, n_ctx=1024, n_threads=2)
    accepted = 0
    for content in ("Repeat this code exactly:\n\n" + CODE,):
        ids = m.chat_prompt_ids([{"role": "user", "content": content}])
        accepted += _check_same(m, ids).accepted_tokens
    assert accepted > N_GEN // 3  # the models copy, and the drafts of the copy were taken


def test_gemma_lookup_past_the_ring_wrap(gemma_path):
    f = gguf_reader.open(gemma_path)
    fm = build_model(f, n_ctx=1024, n_threads=2, n_batch=RING_BATCH)
    m = Model.from_parts(fm, Tokenizer.from_metadata(f.metadata), f.metadata, path=str(gemma_path))
    ring = fm.cache.layers[0].slot_pos.shape[0]
    words = PASSAGE.split()
    for k in range(len(words) * 6):  # a prompt that ends a little before the ring is full
        text = (PASSAGE + "\n\n") * 4 + " ".join((words * 2)[:k])
        ids = m.chat_prompt_ids([{"role": "user", "content": text + "\n\nRepeat the first sentence."}])
        if len(ids) > ring - N_GEN // 2:
            break
    assert ring - N_GEN < len(ids) < ring  # the generation crosses the wrap
    c = _check_same(m, ids)
    assert len(ids) + len(c.tokens) > ring and c.draft_tokens > 0
