"""prompt_logprobs: each prompt token's log-probability given the tokens before it, on both real models, through
Model.complete, the server's scheduler and the llama-cpp-python-shaped create_completion(echo=True, logprobs=n).
The reference is Model.logits (one teacher-forced forward from an empty cache) put through the same
token_logprobs, so every value must be equal, not close: the scored prefill computes the same rows."""
import threading

import pytest

import edgellm
from edgellm.errors import PromptError, SamplingError
from edgellm.generation.options import parse_options
from edgellm.generation.results import Completion
from edgellm.generation.sampling import token_logprobs
from edgellm.generation.scheduler import Scheduler

TOP = 3
TEXT = "The capital of France is Paris. The capital of Germany is Berlin, and its river is the Spree."


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def model(request, smollm2_path, gemma_path):
    return edgellm.load(smollm2_path if request.param == "smollm2" else gemma_path, n_ctx=1024, n_threads=2)


def reference(m, ids, top=TOP):
    """(logprob, {text: logprob} of the top alternatives and the token) per prompt token after the first."""
    rows = m.logits(ids)
    out = []
    for i in range(1, len(ids)):
        lp = token_logprobs(rows[i - 1], ids[i], top)
        alts = {m.tokenizer.token_to_bytes(t).decode("utf-8", errors="ignore"): v
                for t, v in zip(lp.top_ids, lp.top_logprobs)}
        out.append((lp.logprob, {**alts, m.tokenizer.token_to_bytes(ids[i]).decode("utf-8", errors="ignore"):
                                 lp.logprob}))
    return out


def scored(infos):
    return [(i.logprob, i.top_logprobs) for i in infos[1:]]


def test_model_scores_every_prompt_token(model):
    m = model
    ids = m.tokenize(TEXT)
    done = m.complete(ids, max_tokens=0, prompt_logprobs=TOP)
    assert done.completion_tokens == 0 and len(done.prompt_info) == len(ids)
    assert [i.id for i in done.prompt_info] == ids
    assert done.prompt_info[0].logprob is None and done.prompt_info[0].top_logprobs is None
    assert scored(done.prompt_info) == reference(m, ids)
    # offsets: where each token's text starts in the prompt tokens' text
    text = "".join(i.text for i in done.prompt_info)
    assert all(text[i.offset:].startswith(i.text) for i in done.prompt_info)
    # generating after a scored prompt: the same greedy tokens as without scoring
    plain = m.complete(ids, max_tokens=6, temperature=0)
    again = m.complete(ids, max_tokens=6, temperature=0, prompt_logprobs=0)
    assert again.tokens == plain.tokens and [lp for lp, _ in scored(again.prompt_info)] == \
        [lp for lp, _ in reference(m, ids)]
    assert m.complete(ids, max_tokens=2, temperature=0).prompt_info is None
    # batched: each sequence's prompt scored in its own cache
    short = m.tokenize(TEXT[:40])
    batch = m.complete_batch([ids, short], max_tokens=2, temperature=0, prompt_logprobs=TOP)
    assert [scored(c.prompt_info) for c in batch] == [reference(m, ids), reference(m, short)]
    assert batch[0].tokens == plain.tokens[:2]


def test_a_prompt_of_several_batches_is_scored_batch_by_batch(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=1024, n_threads=2)
    ids = m.tokenize(TEXT * 40)
    assert len(ids) > m.model.n_batch  # the scored prefill runs n_batch rows at a time
    done = m.complete(ids, max_tokens=0, prompt_logprobs=1)
    assert scored(done.prompt_info) == reference(m, ids, 1)


def test_the_scheduler_scores_beside_decoding_requests(model):
    """A scored request while another decodes, with chunks small enough that its prompt takes several: its chunks
    run alone (every row kept), it re-uses nothing of the same prompt already in a slot, and both requests give
    what they give alone."""
    m = model
    ids = m.tokenize(TEXT)
    alone = m.complete(ids, max_tokens=4, temperature=0)
    want = reference(m, ids)
    scheduler = Scheduler(m, 2, seq_ctx=512, prefill_chunk=8)
    try:
        first = scheduler.submit(ids, parse_options("t", {"max_tokens": 24, "temperature": 0}, {}))
        events = first.events()
        next(events)  # it decodes: the scored prompt's chunks come beside its steps
        second = scheduler.submit(ids, parse_options("t", {"max_tokens": 4, "temperature": 0,
                                                            "prompt_logprobs": TOP}, {}))
        got = {}

        def read(name, request):
            for event in request.events():
                if isinstance(event, Completion):
                    got[name] = event
        threads = [threading.Thread(target=read, args=("second", second))]
        threads[0].start()
        for event in events:
            if isinstance(event, Completion):
                got["first"] = event
        threads[0].join(timeout=300)
        assert second.reused == 0 and second.prefilled == len(ids)
        assert got["second"].tokens == alone.tokens and got["first"].tokens[:4] == alone.tokens
        assert got["first"].prompt_info is None
        assert scored(got["second"].prompt_info) == want
        only = scheduler.submit(ids, parse_options("t", {"max_tokens": 0, "prompt_logprobs": TOP}, {}))
        done = list(only.events())[-1]
        assert done.completion_tokens == 0 and scored(done.prompt_info) == want
    finally:
        scheduler.close()


def test_echo_with_logprobs_returns_the_prompt_scored(model):
    m = model
    prompt = "The capital of France is"
    ids = m.prompt_ids(prompt)
    r = m.create_completion(prompt, echo=True, logprobs=2, max_tokens=3, temperature=0)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    added_bos = m.tokenizer.add_bos  # a BOS the tokenizer added is not in the text, so not echoed
    n_prompt = len(ids) - added_bos
    assert choice["text"].startswith(prompt) and len(lp["tokens"]) == n_prompt + r["usage"]["completion_tokens"]
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token
    want = reference(m, ids, 2)[-n_prompt:] if added_bos else [(None, None)] + reference(m, ids, 2)
    assert list(zip(lp["token_logprobs"], lp["top_logprobs"]))[:n_prompt] == want
    assert all(v is not None for v in lp["token_logprobs"][n_prompt:])
    # streamed: the echoed prompt first, with the same logprobs, then the same tokens
    chunks = [c["choices"][0] for c in m.create_completion(prompt, echo=True, logprobs=2, max_tokens=3,
                                                           temperature=0, stream=True)]
    assert chunks[0]["text"] == prompt and "".join(c["text"] for c in chunks) == choice["text"]
    streamed = {key: sum((c["logprobs"][key] for c in chunks if c["logprobs"]), []) for key in lp}
    assert streamed == lp
    assert "".join(m.stream(prompt, max_tokens=3, temperature=0, prompt_logprobs=1)) == choice["text"][len(prompt):]
    # max_tokens 0 with echo: the prompt back, scored, nothing generated (OpenAI's scoring call)
    r = m.create_completion(prompt, echo=True, logprobs=0, max_tokens=0)
    assert r["choices"][0]["text"] == prompt and r["usage"]["completion_tokens"] == 0
    assert len(r["choices"][0]["logprobs"]["tokens"]) == n_prompt


def test_bad_prompt_logprobs_are_refused(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=64, n_threads=1)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(SamplingError, match="prompt_logprobs"):
            m.complete("hello", prompt_logprobs=bad)
    long = list(range(100, 160))
    with pytest.raises(PromptError, match="prompt_logprobs"):
        m.complete_batch([long], max_tokens=4, prompt_logprobs=1, seq_ctx=32)
    scheduler = Scheduler(m, 1, seq_ctx=32)
    try:
        request = scheduler.submit(long, parse_options("t", {"max_tokens": 1, "prompt_logprobs": 1}, {}))
        with pytest.raises(PromptError, match="prompt_logprobs"):
            list(request.events())
    finally:
        scheduler.close()
