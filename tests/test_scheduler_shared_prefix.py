"""Requests admitted together that share a prompt prefix (the same system prompt, the same question): each prompt
after the first copies the rows another slot has computed instead of computing them again, and every request's
greedy tokens and logprobs are still exactly what it gives served alone."""
import threading

import edgellm
from edgellm.generation.options import parse_options
from edgellm.generation.results import Completion
from edgellm.generation.scheduler import Scheduler

SYSTEM = ("You are a careful assistant for a bicycle shop. Answer in one short sentence, name the part that "
          "needs attention, and never invent prices or opening hours. ")
PROMPTS = [SYSTEM + "Question: my chain squeaks, what should I do?",
           SYSTEM + "Question: my chain squeaks, what should I do?",   # the same request twice
           SYSTEM + "Question: how often should tyres be pumped?"]    # the same system prompt
MAX_TOKENS = 8


def options():
    return parse_options("test", {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}, {})


def test_admitted_together_they_share_the_prefix_and_keep_their_bits(real_model):
    _, path = real_model
    m = edgellm.load(path, n_ctx=512, n_threads=2)
    ids = [m.tokenize(p) for p in PROMPTS]
    alone = [m.complete(i, max_tokens=MAX_TOKENS, temperature=0, logprobs=2) for i in ids]
    scheduler = Scheduler(m, len(PROMPTS), seq_ctx=512)
    try:
        requests = [scheduler.submit(i, options()) for i in ids]  # all queued before the first turn runs
        done = [None] * len(requests)

        def read(k):
            for event in requests[k].events():
                if isinstance(event, Completion):
                    done[k] = event
        threads = [threading.Thread(target=read, args=(k,)) for k in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        stats = dict(scheduler.stats)
    finally:
        scheduler.close()
    for got, want in zip(done, alone):
        assert got is not None and got.tokens == want.tokens
        assert [(i.id, i.logprob, i.top_logprobs) for i in got.token_info] == \
               [(i.id, i.logprob, i.top_logprobs) for i in want.token_info]
    n_system = len(m.tokenize(SYSTEM))
    # the second and third prompts each take at least the system prompt's rows, less a batch tail whose rows must
    # be computed with the kinds a fresh run gives them (edgellm.engine.prefix)
    assert stats["shared_tokens"] >= 2 * (n_system - 8), (stats, n_system)
    assert stats["prefilled_tokens"] == sum(map(len, ids)) - stats["reused_tokens"]
