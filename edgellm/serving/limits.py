"""Per-request limits, checked before a request takes a slot: the context (prompt plus max_tokens must fit unless
the request opts into shifting), a server-wide cap on max_tokens, OpenAI's bounds on logprobs, and a wall-clock
limit on the generation (counted by the scheduler: edgellm/generation/scheduler.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import HTTPError

MAX_LOGPROBS = 5        # completions' logprobs: OpenAI's bound
MAX_TOP_LOGPROBS = 20   # chat's top_logprobs: OpenAI's bound


@dataclass(frozen=True)
class RequestLimits:
    max_tokens: int | None = None           # the most one request may generate (None: the context bounds it)
    request_timeout_s: float | None = None  # generation ends this long after it starts (None: no limit)

    def __post_init__(self):
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise ValueError(f"the max_tokens cap must be a positive integer, got {self.max_tokens!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"the request timeout must be a positive number of seconds, "
                             f"got {self.request_timeout_s!r}")


def check_logprobs(kwargs: dict, chat: bool) -> None:
    if chat:
        name, value, bound = "top_logprobs", kwargs.get("top_logprobs"), MAX_TOP_LOGPROBS
    else:
        name, value, bound = "logprobs", kwargs.get("logprobs"), MAX_LOGPROBS
    if value is not None and not 0 <= value <= bound:
        raise HTTPError(400, f"'{name}' must be between 0 and {bound}, got {value}", param=name,
                        code="invalid_value")


def fit_max_tokens(n_prompt: int, max_tokens: int | None, n_ctx: int, limits: RequestLimits,
                   may_shift: bool, prompt_param: str) -> int:
    """The number of tokens a request may generate, or a 400 (context_length_exceeded) when its prompt plus
    max_tokens cannot fit. Without max_tokens, what fits (at most the cap), as llama.cpp's server and OpenAI do.
    may_shift: the request asked for context shifting and the model can; then max_tokens may run past the context,
    though the prompt itself must still fit (it is never shifted through)."""
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise HTTPError(400, f"'max_tokens' is {max_tokens}, but this server generates at most {limits.max_tokens} "
                             "tokens per request", param="max_tokens", code="invalid_value")
    room = n_ctx - n_prompt
    if room < 1:
        raise HTTPError(400, f"this model's context holds {n_ctx} tokens, but the prompt alone has {n_prompt} "
                             "(at least one position is needed for the reply); shorten it",
                        param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return room if limits.max_tokens is None else min(room, limits.max_tokens)
    if max_tokens > room and not may_shift:
        raise HTTPError(400, f"this model's context holds {n_ctx} tokens, but {n_prompt + max_tokens} were "
                             f"requested ({n_prompt} in the prompt, {max_tokens} to generate); lower max_tokens, "
                             "shorten the prompt, or send \"context_shift\": true to let old tokens go",
                        param="max_tokens", code="context_length_exceeded")
    return max_tokens
