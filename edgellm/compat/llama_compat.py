"""`Model.create_completion` and `Model.create_chat_completion`: llama-cpp-python's calls, defaults and dict
shapes (built by edgellm/compat/completions.py), on edgellm's decode loop.

Kept the same as llama-cpp-python 0.3: the defaults of each call (completion: max_tokens 16, temperature 0.8;
chat: max_tokens None, temperature 0.2), max_tokens None or <= 0 meaning "until the context is full", usage
counting every generated token, logprobs of the unmodified distribution, text_offset counted from the start of
the prompt text, one final chunk with text "" and the finish_reason. Differs on purpose: a streamed chunk carries
whole UTF-8 characters (llama-cpp-python may cut one), and the logprobs of the tokens that made its text; chat
logprobs=True without top_logprobs gives the chosen tokens' logprobs (llama-cpp-python gives none); echo with
logprobs scores each prompt token from the row before it (llama-cpp-python pairs the echoed tokens with the rows
from the first, one row late where it strips no BOS), with null for a first token that has nothing before it, and
echo with max_tokens 0 generates nothing, as OpenAI's API (for scoring: lm-eval's loglikelihood); streamed, the
echoed prompt's chunk carries its logprobs, sent once it is scored.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from edgellm.compat.completions import (chat_chunk, chat_chunks, chat_completion_id, chat_completion_response,
                                        completion_chunk, completion_logprobs, completion_response,
                                        new_completion_id, now)
from edgellm.compat.tool_calls import ChatPlan
from edgellm.compat.tool_stream import ToolCallStream
from edgellm.errors import SamplingError
from edgellm.generation.options import parse_options
from edgellm.generation.results import Completion, PromptScored

COMPLETION_DEFAULTS = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0,
                       "top_k": 40, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
CHAT_DEFAULTS = {**COMPLETION_DEFAULTS, "max_tokens": None, "temperature": 0.2}


def _normalise_max_tokens(kwargs: dict, default) -> None:
    value = kwargs.get("max_tokens", default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value <= 0):
        kwargs["max_tokens"] = None


def _logprobs_dict(infos, base_offset: int) -> dict:
    return completion_logprobs([i.text for i in infos], [base_offset + i.offset for i in infos],
                               [i.logprob for i in infos], [i.top_logprobs for i in infos])


def _completion_result(events):
    for event in events:
        if isinstance(event, Completion):
            return event
    raise AssertionError("the decode loop ended without a Completion")


def _prepare(llm, caller: str, ids_of, kwargs: dict, defaults: dict):
    model_name = kwargs.get("model") or llm.path
    _normalise_max_tokens(kwargs, defaults["max_tokens"])
    opts = parse_options(caller, kwargs, defaults, allow_compat=True)
    return model_name, opts, ids_of()


# ---------------------------------------------------------------------------------------------------------------
# Text completions
# ---------------------------------------------------------------------------------------------------------------

def create_completion(llm, prompt, *, stream: bool = False, echo: bool = False, **kwargs):
    """A CreateCompletionResponse dict, or (stream=True) an iterator of completion chunks."""
    scoring = echo and kwargs.get("logprobs") is not None
    if scoring:
        kwargs["prompt_logprobs"] = kwargs["logprobs"]
    echo_only = echo and kwargs.get("max_tokens") == 0  # the prompt back (and scored), nothing generated
    model_name, opts, ids = _prepare(llm, "create_completion", lambda: llm.prompt_ids(prompt), kwargs,
                                     COMPLETION_DEFAULTS)
    if echo_only:
        opts = replace(opts, max_tokens=0)
    prompt_text = prompt if isinstance(prompt, str) else llm.detokenize(ids)
    base_offset = len(prompt_text)  # text_offset counts from the start of the prompt, echoed or not
    events = llm.decode_events(ids, opts)
    completion_id, created = new_completion_id(), now()
    if stream:
        return _completion_chunks(events, completion_id, created, model_name, opts, base_offset,
                                  prompt_text if echo else "", partial(_echoed, llm, prompt))
    done = _completion_result(events)
    logprobs = _logprobs_dict(done.token_info, base_offset) if opts.logprobs is not None else None
    if scoring:
        logprobs = _merged_logprobs(_logprobs_dict(_echoed(llm, prompt, done.prompt_info), 0), logprobs)
    return completion_response(completion_id=completion_id, created=created, model=model_name,
                               text=(prompt_text if echo else "") + done.text, finish_reason=done.finish_reason,
                               prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                               logprobs=logprobs, completion_tokens_details=speculation_details(done))


def _echoed(llm, prompt, infos) -> list:
    """The prompt tokens' TokenInfo as echoed: without a BOS the tokenizer added to a text prompt (it is not in
    the text), offsets counted from the echoed text's start."""
    tok = llm.tokenizer
    if isinstance(prompt, (str, bytes)) and len(infos) > 1 and tok.add_bos and infos[0].id == tok.bos_id:
        first = infos[1].offset
        infos = [replace(i, offset=i.offset - first) for i in infos[1:]]
    return infos


def _merged_logprobs(prompt: dict, generated: dict) -> dict:
    return {key: prompt[key] + generated[key] for key in prompt}


def _completion_chunks(events, completion_id, created, model_name, opts, base_offset, echo_text, echoed=None):
    """echoed: the prompt's TokenInfo as echoed (_echoed), for a scored prompt's first chunk."""
    common = {"completion_id": completion_id, "created": created, "model": model_name}
    try:
        if echo_text and opts.prompt_logprobs is None:
            yield completion_chunk(text=echo_text, **common)
            echo_text = ""
        pending = []  # tokens whose text has not been sent yet
        for event in events:
            if isinstance(event, PromptScored):  # the echoed prompt, scored, before any token
                if echo_text:
                    yield completion_chunk(text=echo_text, logprobs=_logprobs_dict(echoed(event.infos), 0),
                                           **common)
                    echo_text = ""
                continue
            if isinstance(event, Completion):
                if echo_text:  # cancelled before the prompt was scored
                    yield completion_chunk(text=echo_text, **common)
                yield completion_chunk(text="", finish_reason=event.finish_reason, **common)
                return
            piece, info = event
            if info is not None:
                pending.append(info)
            if piece:
                logprobs = _logprobs_dict(pending, base_offset) if opts.logprobs is not None and pending else None
                yield completion_chunk(text=piece, logprobs=logprobs, **common)
                pending = []
    finally:
        events.close()  # a consumer that stops early frees the model at once


# ---------------------------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------------------------

def create_chat_completion(llm, messages, *, stream: bool = False, logprobs: bool | None = False,
                           top_logprobs: int | None = None, tools=None, tool_choice=None, parallel_tool_calls=None,
                           functions=None, function_call=None, chat_template_kwargs=None, **kwargs):
    """A CreateChatCompletionResponse dict, or (stream=True) an iterator of chat.completion.chunk dicts.

    tools / tool_choice / parallel_tool_calls (and the older functions / function_call) as OpenAI's API;
    chat_template_kwargs are extra template variables (e.g. enable_thinking)."""
    if logprobs not in (None, True, False):
        raise SamplingError(f"logprobs must be True or False for a chat completion, got {logprobs!r}")
    if top_logprobs is not None and not logprobs:
        raise SamplingError("top_logprobs needs logprobs=True")
    kwargs["logprobs"] = (top_logprobs or 0) if logprobs else None
    plan = ChatPlan(llm, messages, tools, tool_choice, parallel_tool_calls, functions, function_call,
                    chat_template_kwargs)
    if plan.grammar is not None:
        if any(kwargs.get(n) is not None and kwargs.get(n) != {"type": "text"}
               for n in ("grammar", "response_format", "json_schema", "regex", "choice")):
            raise SamplingError("tool_choice constrains the reply with the tools' schemas; it cannot be combined "
                                "with grammar or response_format")
        kwargs["grammar"] = plan.grammar
    model_name, opts, ids = _prepare(llm, "create_chat_completion", lambda: plan.ids, kwargs, CHAT_DEFAULTS)
    events = llm.decode_events(ids, opts)
    completion_id, created = new_completion_id(), now()
    if stream and plan.format is None:
        return _chat_stream(_completion_chunks(events, completion_id, created, model_name, opts, 0, ""))
    if stream:  # calls streamed as OpenAI does: id and name first, then the arguments' text
        return _tool_call_stream(llm, plan, events, completion_id, created, model_name, opts)
    done = _completion_result(events)
    completion = _completion_dict(done, completion_id, created, model_name, opts)
    message, finish = plan.reply(llm, done)
    return chat_completion_response(completion, message, finish)


def _completion_dict(done, completion_id, created, model_name, opts):
    return completion_response(
        completion_id=completion_id, created=created, model=model_name, text=done.text,
        finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
        logprobs=_logprobs_dict(done.token_info, 0) if opts.logprobs is not None else None,
        completion_tokens_details=speculation_details(done))


def speculation_details(done):
    """usage's completion_tokens_details under speculative decoding (None without): drafted tokens the target
    accepted and rejected, as OpenAI reports its predicted outputs."""
    if done.speculative is None:
        return None
    return {"accepted_prediction_tokens": done.accepted_tokens,
            "rejected_prediction_tokens": done.draft_tokens - done.accepted_tokens}


def _chat_stream(chunks):
    try:
        yield from chat_chunks(chunks)
    finally:
        chunks.close()


def _tool_call_stream(llm, plan, events, completion_id, created, model_name, opts):
    """Content and tool calls as OpenAI streams them, each delta sent once the reply so far settles it."""
    common = {"chat_id": chat_completion_id(completion_id), "created": created, "model": model_name}
    stream = ToolCallStream(plan.format, plan.parallel, plan.opens_thinking)
    ids, text = [], ""
    try:
        yield chat_chunk(delta={"role": "assistant"}, **common)
        done = None
        for event in events:
            if isinstance(event, Completion):
                done = event
                break
            if isinstance(event, PromptScored):
                continue
            piece, info = event
            text += piece or ""
            if info is not None:
                ids.append(info.id)
            # native formats mark calls with special tokens; an incomplete UTF-8 character waits for its rest
            raw = text if plan.format == "generic" else llm.detokenize(ids, special=True).rstrip("\ufffd")
            for delta in stream.update(raw):
                yield chat_chunk(delta=delta, **common)
    finally:
        events.close()
    message, finish = plan.reply(llm, done)
    for delta in stream.finish(message):
        yield chat_chunk(delta=delta, **common)
    yield chat_chunk(delta={}, finish_reason=finish, **common)
