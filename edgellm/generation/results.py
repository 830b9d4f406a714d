"""What generating calls return: Timings (llama.cpp's timing figures), TokenInfo (one generated token), Completion.

Re-exported by edgellm.api, where they were first defined."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Timings:
    """What the last generation cost, as llama.cpp reports it."""
    load_s: float = 0.0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    reused_tokens: int = 0  # of prompt_tokens, taken from the KV cache rather than evaluated
    generated_tokens: int = 0
    generate_s: float = 0.0
    sample_s: float = 0.0  # inside generate_s: logit processors, penalties, filters and the draw
    mask_s: float = 0.0  # inside generate_s: a constraint's token masks and matcher advances
    # Numba compiling kernels (first run only): at load when it precompiled, plus any on first use during the call;
    # in none of the times above
    compile_s: float = 0.0
    # speculative decoding: tokens drafted and, of those, accepted by the target (0 and 0 without speculation)
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        # The first generated token comes from the prompt's logits; the rest each cost one decode step.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def sample_share(self) -> float:
        return self.sample_s / self.generate_s if self.generate_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} t/s | "
                f"generation: {self.generated_tokens} tokens, {self.generate_tps:.1f} t/s | load {self.load_s:.2f} s"
                + (f" | drafted {self.draft_tokens}, accepted {self.accepted_tokens} "
                   f"({100 * self.acceptance_rate:.0f}%)" if self.draft_tokens else "")
                + (f" | compile {self.compile_s:.1f} s (first run only)" if self.compile_s > 0 else ""))


@dataclass
class TokenInfo:
    """One generated token: its text, where that text starts in the completion, and its log-probabilities."""
    id: int
    text: str
    offset: int  # characters into the generated text (stop strings included) where this token's text begins
    logprob: float | None = None
    top_logprobs: dict | None = None  # token text -> logprob for the top-n alternatives and the chosen token


def top_logprobs_entry(token_text: str, token_logprob: float, alternatives: Iterable[tuple[str, float]]) -> dict:
    """One top_logprobs item: {text: logprob} for the top-n alternatives, then the chosen token's own entry.

    Keyed by token text as llama-cpp-python does, so two tokens with the same text share one key.
    """
    entry = {text: float(lp) for text, lp in alternatives}
    entry[token_text] = float(token_logprob)
    return entry


@dataclass
class PromptScored:
    """Where prompt_logprobs was asked, the decode loop's event between the prompt and the first token: the
    prompt's TokenInfo (Completion.prompt_info again at the end), so a stream can send the scored prompt first."""
    infos: list


@dataclass
class Completion:
    """The result of a generation.

    finish_reason is llama-cpp-python's: "stop" (end-of-generation token, stop string or stopping criterion) or
    "length" (max_tokens or a full context); stop_reason says which: "eog", "stop_string", "criteria", "length",
    "constraint" (a grammar or schema completed), "time_limit" (the server's --request-timeout: finish_reason
    "length", as llama-server's t_max_predict_ms), or "cancelled" (Model.cancel(), finish_reason "stop" as for a
    stopping criterion in llama-cpp-python).
    """
    text: str
    tokens: list = field(default_factory=list)
    finish_reason: str = "length"
    prompt_tokens: int = 0
    stop_reason: str = "length"
    stop_string: str | None = None
    # TokenInfo per generated token (logprobs filled when asked); as in llama-cpp-python, the tokens of a matched
    # stop string are included (and counted in usage) although their text is cut
    token_info: list = field(default_factory=list)
    # speculative decoding (edgellm.generation.speculative): the mode used, None when off; tokens drafted and
    # accepted (every generated token is the target's either way)
    speculative: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # with prompt_logprobs: TokenInfo per prompt token, its logprob given the tokens before it (None for the
    # first), offsets in characters into the prompt tokens' own text
    prompt_info: list | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)
