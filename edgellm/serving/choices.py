"""Several choices in one request: OpenAI's `n`, and /v1/completions' list of prompts.

Each choice is a request of its own on the scheduler, so a request's choices decode together in the batch, beside
other clients' requests. The answers are merged here into one response. Choice i of prompt p has index p * n + i,
as OpenAI numbers them. A seeded request's choice i samples with seed + i: choice 0 is the reply the same request
gets with n = 1, and the others differ from it.
"""
from __future__ import annotations

from .errors import HTTPError

MAX_CHOICES = 16  # choices a request may ask for (n x prompts): each takes a slot, so the rest only queue


def check_choices(n, best_of, n_prompts: int) -> int:
    """The request's n (1 when not given), or a 400 naming the field."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise HTTPError(400, f"'n' must be from 1 to {MAX_CHOICES}, got {n}", param="n", code="invalid_value")
    if best_of not in (None, 1, n):  # best_of = n returns every choice made, so it is n's answer
        raise HTTPError(400, "'best_of' must be 1 or equal n: edgellm returns every choice it makes",
                        param="best_of", code="invalid_value")
    if n * n_prompts > MAX_CHOICES:
        raise HTTPError(400, f"{n_prompts} prompts x n = {n} asks for {n * n_prompts} choices; at most {MAX_CHOICES} "
                             "a request", param="prompt", code="invalid_value")
    return n


def choice_kwargs(kwargs: dict, n: int) -> list[dict]:
    """Each choice's call arguments: the request's, choice i's seed seed + i."""
    seed = kwargs.get("seed")
    return [kwargs if seed is None or i == 0 else {**kwargs, "seed": seed + i} for i in range(n)]


def _sum_usage(usages: list[dict], n: int) -> dict:
    """The request's usage: each prompt counted once (its first choice's), every choice's completion tokens, and the
    speculation counts (completion_tokens_details) summed."""
    first = usages[::n]
    out = {"prompt_tokens": sum(u["prompt_tokens"] for u in first),
           "completion_tokens": sum(u["completion_tokens"] for u in usages)}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    details = [u.get("completion_tokens_details") for u in usages]
    if any(details):
        merged: dict = {}
        for d in filter(None, details):
            for key, value in d.items():
                merged[key] = merged.get(key, 0) + value
        out["completion_tokens_details"] = merged
    return out


def merged_response(results: list[dict], n: int) -> dict:
    """One response from the choices' own (prompt-major, n each): the first's id and fields, every choice at its
    index, the usage summed."""
    choices = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
    return {**results[0], "choices": choices, "usage": _sum_usage([r["usage"] for r in results], n)}


def stream_usage(completions: list, n: int) -> dict:
    """A stream's closing usage from its choices' Completions (prompt-major, n each)."""
    return _sum_usage([{"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}
                       for c in completions], n)


def reindexed(chunk: dict, index: int, first: dict) -> dict:
    """A choice's stream chunk as the request's: its choice at `index`, and the id and created time of the request's
    first chunk (each choice's call made its own)."""
    return {**chunk, "id": first["id"], "created": first["created"],
            "choices": [{**c, "index": index} for c in chunk["choices"]]}
