"""Generation options: every keyword `generate`, `stream`, `chat` and the llama-cpp-python-shaped calls accept,
checked once, by name, before any work is done.

Sections: the accepted names (edgellm's own, plus llama-cpp-python's that edgellm accepts only at their neutral
value); `GenerationOptions`, the validated bundle the decode loop reads; `parse_options`, which builds it and names
the offending argument in every error.
"""
from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, fields
from typing import Callable

from edgellm.errors import SamplingError
from edgellm.generation.sampling import SamplingParams, _check_seed
from edgellm.generation.speculative import check_lengths
from edgellm.generation.textstream import _as_stop_list

SAMPLING_NAMES = tuple(f.name for f in fields(SamplingParams))
GENERATION_NAMES = ("max_tokens", "stop", "seed", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias",
                    "logits_processor", "stopping_criteria", "grammar", "response_format", "json_schema", "regex",
                    "choice", "speculative", "draft_max", "draft_min")
MODEL_DEFAULT = "model-default"  # GenerationOptions.speculative when the call names none: the model's load() choice

# llama-cpp-python arguments with no edgellm counterpart: accepted at the value that means "off", so code passing
# its defaults explicitly still runs; anything else is refused rather than silently ignored.
NEUTRAL_VALUES = {
    "tfs_z": (1.0,),
    "mirostat_mode": (0,),
    "mirostat_tau": None,  # None: any value (only read when mirostat_mode is on)
    "mirostat_eta": None,
    "suffix": (None,),
    "functions": (None,),
    "function_call": (None,),
    "tools": (None,),
    "tool_choice": (None,),
    "model": None,  # only names the model in the response, as in llama-cpp-python
}


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingParams
    max_tokens: int | None = 128  # None: until end-of-generation or a full context
    stop: tuple = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the n most likely alternatives'
    # None: off; n: each prompt token's logprob given the tokens before it, and the n most likely alternatives', in
    # Completion.prompt_info (the prompt is then prefilled whole, every row's logits computed: nothing is re-used)
    prompt_logprobs: int | None = None
    logit_bias: dict | None = None  # token id -> added to its logit before sampling
    logits_processor: Callable | None = None  # f(input_ids, scores) -> scores, llama-cpp-python's signature
    stopping_criteria: Callable | None = None  # f(input_ids, logits) -> bool: True ends with finish_reason "stop"
    constraint: object | None = None  # edgellm.generation.constrain.ConstraintSpec: what every generated token must fit
    speculative: str | None = MODEL_DEFAULT  # None (off), "lookup", "draft" (edgellm.generation.speculative)
    draft_max: int | None = None  # most tokens drafted per step (0: speculation off for this call); None: the mode's
    draft_min: int = 0  # a shorter draft is not verified (the step decodes plainly)


def _unexpected(caller: str, name: str, accepted) -> TypeError:
    close = difflib.get_close_matches(name, list(accepted), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")


def _check_logit_bias(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SamplingError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    out = {}
    for key, bias in value.items():
        try:  # OpenAI clients send the ids as JSON object keys, i.e. strings
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
            raise SamplingError(f"logit_bias[{key!r}] must be a number, got {bias!r}")
        out[token] = float(bias)
    return out


def _check_callable(name: str, value):
    if value is not None and not callable(value):
        raise SamplingError(f"{name} must be callable (or a list of callables), got {type(value).__name__}")
    return value


def _as_callable_chain(name: str, value, combine):
    # llama-cpp-python's LogitsProcessorList / StoppingCriteriaList are lists of callables
    if isinstance(value, (list, tuple)):
        funcs = [_check_callable(f"{name}[{i}]", f) for i, f in enumerate(value)]
        return combine(funcs) if funcs else None
    return _check_callable(name, value)


def _chain_processors(funcs):
    def run(input_ids, scores):
        for f in funcs:
            scores = f(input_ids, scores)
        return scores
    return run


def _any_criterion(funcs):
    return lambda input_ids, logits: any(f(input_ids, logits) for f in funcs)


def parse_options(caller: str, kwargs: dict, defaults: dict, allow_compat: bool = False) -> GenerationOptions:
    """Validate keyword arguments for `caller` (named in errors); `defaults` fills what the caller left out.

    allow_compat admits llama-cpp-python's extra names (at their neutral values)."""
    accepted = set(SAMPLING_NAMES) | set(GENERATION_NAMES) | (set(NEUTRAL_VALUES) if allow_compat else set())
    for name in kwargs:
        if name not in accepted:
            raise _unexpected(caller, name, accepted)
    values = {**defaults, **kwargs}
    for name, allowed in NEUTRAL_VALUES.items():
        if name in values and allowed is not None and values[name] not in allowed:
            raise SamplingError(f"{name}={values[name]!r} is not supported by edgellm "
                                f"(accepted: {', '.join(repr(a) for a in allowed)})")

    sampling = SamplingParams(**{n: values[n] for n in SAMPLING_NAMES if n in values and values[n] is not None})
    max_tokens = values.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral)
                                   or max_tokens < 0):
        raise SamplingError(f"max_tokens must be None or an integer >= 0, got {max_tokens!r}")
    logprobs, prompt_logprobs = _check_count(values, "logprobs"), _check_count(values, "prompt_logprobs")
    check_lengths(values.get("draft_max"), values.get("draft_min"))
    ignore_eos = values.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise SamplingError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    return GenerationOptions(
        sampling=sampling,
        max_tokens=None if max_tokens is None else int(max_tokens),
        stop=_as_stop_list(values.get("stop")),
        seed=_check_seed(values.get("seed")),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_check_logit_bias(values.get("logit_bias")),
        logits_processor=_as_callable_chain("logits_processor", values.get("logits_processor"), _chain_processors),
        stopping_criteria=_as_callable_chain("stopping_criteria", values.get("stopping_criteria"), _any_criterion),
        constraint=_constraint(values),
        speculative=_check_speculative(values.get("speculative", MODEL_DEFAULT)),
        draft_max=values.get("draft_max"),
        draft_min=values.get("draft_min") or 0,
    )


def _check_count(values: dict, name: str) -> int | None:
    value = values.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
        raise SamplingError(f"{name} must be None or an integer >= 0 (the number of alternatives), got {value!r}")
    return None if value is None else int(value)


def _constraint(values):
    if all(values.get(n) is None for n in ("grammar", "response_format", "json_schema", "regex", "choice")):
        return None  # start-up time: constrained decoding's module is imported when a constraint is asked for
    from edgellm.generation.constrain import constraint_from_options
    return constraint_from_options(values)


def _check_speculative(value):
    if value is MODEL_DEFAULT or value is None or value is False or value in ("lookup", "draft"):
        return None if value is False else value
    raise SamplingError(f"speculative must be None, 'lookup' or 'draft', got {value!r}")
