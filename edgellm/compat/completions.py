"""Response dicts shaped exactly like llama-cpp-python's (llama_types.py), so code written for it runs unchanged.

Sections: ids and timestamps; text completions (`create_completion`, whole and streamed); logprobs in the
completion shape (text_offset, token_logprobs, tokens, top_logprobs) and the chat shape; chat completions
(`create_chat_completion`, whole and streamed), built from the completion dicts the way llama-cpp-python's
chat handlers convert them (the chat id is "chat" + the completion id: "chatcmpl-...").
"""
from __future__ import annotations

import time
import uuid
from typing import Iterable, Iterator, Mapping, Sequence

from edgellm.errors import SamplingError
from edgellm.generation.results import top_logprobs_entry  # noqa: F401  (part of this module's API)

FINISH_REASONS = ("stop", "length", "tool_calls")


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4()}"


def now() -> int:
    return int(time.time())


def _check_finish_reason(reason) -> None:
    if reason is not None and reason not in FINISH_REASONS:
        raise SamplingError(f"finish_reason must be None or one of {FINISH_REASONS}, got {reason!r}")


# ---------------------------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------------------------

def completion_logprobs(tokens: Sequence[str], text_offset: Sequence[int],
                        token_logprobs: Sequence[float | None],
                        top_logprobs: Sequence[dict | None]) -> dict:
    """The CompletionLogprobs dict; the four lists run in parallel, one item per generated token."""
    n = len(tokens)
    if not (len(text_offset) == len(token_logprobs) == len(top_logprobs) == n):
        raise ValueError(f"logprobs lists differ in length: tokens {n}, text_offset {len(text_offset)}, "
                         f"token_logprobs {len(token_logprobs)}, top_logprobs {len(top_logprobs)}")
    return {
        "tokens": list(tokens),
        "text_offset": [int(o) for o in text_offset],
        "token_logprobs": [None if lp is None else float(lp) for lp in token_logprobs],
        "top_logprobs": [None if t is None else dict(t) for t in top_logprobs],
    }


def chat_logprobs(logprobs: Mapping | None) -> dict | None:
    """Completion-shaped logprobs as the chat shape: {"content": [{token, bytes, logprob, top_logprobs}], "refusal"}."""
    if logprobs is None:
        return None
    content = []
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        content.append({
            "token": token,
            "bytes": None,
            "logprob": logprob,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in (top or {}).items()],
        })
    return {"content": content, "refusal": None}


# ---------------------------------------------------------------------------------------------------------------
# Text completions
# ---------------------------------------------------------------------------------------------------------------

def completion_response(*, completion_id: str, created: int, model: str, text: str, finish_reason: str,
                        prompt_tokens: int, completion_tokens: int, logprobs: dict | None = None,
                        completion_tokens_details: dict | None = None) -> dict:
    """CreateCompletionResponse: the whole result of create_completion(stream=False). completion_tokens_details:
    added to usage when given (speculative decoding's accepted / rejected drafted tokens, OpenAI's names)."""
    _check_finish_reason(finish_reason)
    response = {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if completion_tokens_details is not None:
        response["usage"]["completion_tokens_details"] = dict(completion_tokens_details)
    return response


def completion_chunk(*, completion_id: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """One item of create_completion(stream=True): no usage; the last chunk has text "" and the finish_reason."""
    _check_finish_reason(finish_reason)
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


# ---------------------------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------------------------

def chat_completion_id(completion_id: str) -> str:
    return "chat" + completion_id


def chat_completion_response(completion: Mapping, message: dict | None = None,
                             finish_reason: str | None = None) -> dict:
    """CreateChatCompletionResponse from a finished text completion (message: the assistant message when it is
    more than the text, e.g. tool_calls or reasoning_content)."""
    choice = completion["choices"][0]
    return {
        "id": chat_completion_id(completion["id"]),
        "object": "chat.completion",
        "created": completion["created"],
        "model": completion["model"],
        "choices": [{
            "index": 0,
            "message": message or {"role": "assistant", "content": choice["text"]},
            "logprobs": chat_logprobs(choice["logprobs"]),
            "finish_reason": finish_reason or choice["finish_reason"],
        }],
        "usage": dict(completion["usage"]),
    }


def chat_chunk(*, chat_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    """One chat.completion.chunk. delta is {"role": "assistant"}, {"content": text}, or {} on the last chunk."""
    _check_finish_reason(finish_reason)
    return {
        "id": chat_id,
        "model": model,
        "created": created,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_chunks(completion_chunks: Iterable[Mapping]) -> Iterator[dict]:
    """Streamed text-completion chunks as chat chunks: a role chunk first, then one per chunk, the last with delta {}."""
    for i, chunk in enumerate(completion_chunks):
        chat_id = chat_completion_id(chunk["id"])
        choice = chunk["choices"][0]
        if i == 0:
            yield chat_chunk(chat_id=chat_id, created=chunk["created"], model=chunk["model"],
                             delta={"role": "assistant"})
        finished = choice["finish_reason"] is not None
        yield chat_chunk(chat_id=chat_id, created=chunk["created"], model=chunk["model"],
                         delta={} if finished else {"content": choice["text"]},
                         finish_reason=choice["finish_reason"], logprobs=chat_logprobs(choice["logprobs"]))
