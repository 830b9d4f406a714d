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
        # the same prompt again takes the first one's rows and last row's logits: nothing of it is computed
        assert (requests[1].reused, requests[1].prefilled) == (len(ids[1]), 0)
        assert requests[2].prefilled > 0
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


def test_the_same_prompt_again_runs_nothing_and_keeps_its_bits(real_model):
    """One request after another on one slot (a regenerated reply, a client repeating itself): the second takes the
    first's prompt rows and its last row's logits, and gives the same tokens and logprobs as served alone; a
    different prompt then prefills as before, and the first prompt after it again finds its rows gone."""
    _, path = real_model
    m = edgellm.load(path, n_ctx=512, n_threads=2)
    ids = [m.tokenize(p) for p in PROMPTS]
    alone = [m.complete(i, max_tokens=MAX_TOKENS, temperature=0, logprobs=2) for i in ids]
    scheduler = Scheduler(m, 1, seq_ctx=512)
    got = []
    try:
        for k in (0, 1, 2, 0):  # 1 is 0's prompt
            request = scheduler.submit(ids[k], options())
            done = [e for e in request.events() if isinstance(e, Completion)][0]
            got.append((k, request.reused, request.prefilled, done))
    finally:
        scheduler.close()
    for k, _, _, done in got:
        assert done.tokens == alone[k].tokens
        assert [(i.id, i.logprob, i.top_logprobs) for i in done.token_info] == \
               [(i.id, i.logprob, i.top_logprobs) for i in alone[k].token_info]
    assert got[1][1:3] == (len(ids[1]), 0)  # the whole prompt, nothing run
    assert got[2][2] > 0 and got[3][2] > 0  # another prompt replaced the rows: prefilled again (in part)


def test_a_prompt_cut_mid_prefill_leaves_no_stale_row(real_model):
    """A prefilled whole, then another prompt with the same system prompt (re-using those rows) cancelled after its
    first chunks replaced A's other rows: A again must not take its old logits row over rows that are no longer its
    own; it prefills, with the bits served alone gives."""
    import time
    _, path = real_model
    m = edgellm.load(path, n_ctx=512, n_threads=2)
    a = m.tokenize(PROMPTS[0])
    b = m.tokenize(SYSTEM + "Question: " + "tell me about wheels, spokes and rims. " * 30)
    alone = m.complete(a, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    scheduler = Scheduler(m, 1, seq_ctx=512, prefill_chunk=16)
    try:
        first = scheduler.submit(a, options())
        list(first.events())
        cut = scheduler.submit(b, options())
        deadline = time.monotonic() + 60
        while cut.reused + cut.prefilled <= len(a) and time.monotonic() < deadline:  # past A's length
            time.sleep(0.0005)
        cut.cancel()
        list(cut.events())
        again = scheduler.submit(a, options())
        done = [e for e in again.events() if isinstance(e, Completion)][0]
    finally:
        scheduler.close()
    assert cut.reused > 0 and len(a) < cut.reused + cut.prefilled < len(b)  # re-used A's start, cut past A's end
    assert again.prefilled > 0 and again.reused < len(a)
    assert done.tokens == alone.tokens
    assert [(i.id, i.logprob) for i in done.token_info] == [(i.id, i.logprob) for i in alone.token_info]
