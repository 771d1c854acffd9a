"""Requests of the engine: sampling parameters, the per-request state the scheduler moves, and the results.

A request's tokens are ``prompt + output``. Its KV holds the first ``num_computed`` of them. Prefill computes
up to :attr:`Request.prefill_target`: the whole prompt for a new request (the last prompt token's logits give
the first output token), or all tokens but the last after a preemption (recompute: the outputs are kept, the
last one is the next decode input). Decode then feeds ``tokens[-1]`` and samples one token per step.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request generates.

    ``temperature`` 0 is greedy (argmax, lowest id on ties); otherwise the softmax of ``logits / temperature``
    restricted to the smallest top-p set is sampled with a generator seeded by ``(seed, output index)``, so a
    request's tokens do not depend on what it was batched with (nor on preemption). Generation stops after
    ``max_new_tokens``, after a token in ``stop_token_ids`` (kept in the output), or at the engine's
    ``max_model_len``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens: {self.max_new_tokens!r} must be an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: {self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p!r} must be in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(str, Enum):
    WAITING = "waiting"          # queued (new, or preempted for recompute): holds no pages
    PREFILL = "prefill"          # admitted to the prefill pool, some prefill tokens left
    HANDOFF = "handoff"          # prefilled; waits for room in the decode pool (two-pool recipes only)
    DECODE = "decode"            # in the decode pool, one token per step
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class RequestResult:
    """What the engine reports for a finished or aborted request (times in seconds, ``time.perf_counter``)."""

    request_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str                 # "stop" | "length" | "aborted"
    abort_reason: str | None
    arrival_s: float
    first_token_s: float | None        # None when aborted before its first token
    finish_s: float
    token_s: list[float]               # time each output token was produced
    num_preemptions: int = 0
    num_cached_tokens: int = 0         # prompt tokens served from shared prefix pages instead of computed
    logits: torch.Tensor | None = None  # fp32 [len(output_ids), vocab] on the CPU (engine record_logits=True)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first output token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (inter-token latency)."""
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1)

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(eq=False)
class Request:
    """Engine-internal mutable state of one request."""

    id: Hashable
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0              # tokens whose KV is in the current pool's pages
    status: Status = Status.WAITING
    pool: str | None = None            # "prefill" | "decode" while it holds pages
    first_token_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV prefill must compute before decode (all but the last once outputs exist)."""
        return len(self.tokens) - 1 if self.output else len(self.tokens)

    @property
    def samples_after_prefill(self) -> bool:
        """A new request samples its first token from the last prefill logits; a recomputed one does not."""
        return not self.output

    def result(self, finish_reason: str, finish_s: float, abort_reason: str | None = None) -> RequestResult:
        logits = torch.stack(self.logits) if self.logits else None
        return RequestResult(self.id, list(self.prompt), self.output, finish_reason, abort_reason, self.arrival_s,
                             self.first_token_s, finish_s, list(self.token_s), self.num_preemptions,
                             self.num_cached_tokens, logits)


def check_prompt(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, or a ValueError naming what is wrong with it."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point:
            raise ValueError(f"prompt_ids: expected a 1-D integer tensor, got {prompt_ids.dtype} "
                             f"{tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids: empty prompt (at least one token is needed to predict the next)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt_ids: {len(ids)} tokens leave no room to generate within the model's context of "
                         f"{max_model_len} tokens (max_model_len)")
    return ids


__all__ = ["SamplingParams", "Status", "Request", "RequestResult", "check_prompt"]
