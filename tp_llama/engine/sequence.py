"""A request's sequence from admission to its last token: what the scheduler, the sampler and the
front doors read and write of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tp_llama.engine.sampling import SamplingParams, TokenLogprobs, check_params

if TYPE_CHECKING:
    from tp_llama.engine.constraint import Constraint


@dataclass(eq=False)
class Sequence:
    """One request from admission to its last token; the handler and the CLI hold it by id."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefixes are shared only between requests of the same salt
    adapter: str | None = None  # the LoRA adapter it runs on, by name (None: the base model)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    blocks: list[int] = field(default_factory=list)  # block table: the KV-cache blocks of positions 0, B, 2B, ...
    keys: list[int] = field(default_factory=list)  # the prefix-cache key of each full block in `blocks`
    computed: int = 0  # tokens already written to the KV cache
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    preemptions: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    reported: int = 0  # output tokens already handed to the client
    constraint: Constraint | None = None  # a structured output's grammar state (rank 0; engine/constraint.py)
    # n > 1: a fork names its group's first sequence (same prompt, params and cache salt), which carries
    # it (`forks`) until their first token; from then on each sequence of the group is on its own.
    fork_of: Sequence | None = None
    forks: list[Sequence] = field(default_factory=list)
    copy: tuple[int, int] | None = None  # a new fork's block copy (src, dst), sent with its next row

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output

    @property
    def prefilling(self) -> bool:
        """More than the newest token still to compute: a prompt, or the tokens of a preempted sequence."""
        return self.computed < len(self.prompt_ids) + len(self.output) - 1 or not self.output

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprobs]]:
        """Output tokens not handed out before (for streaming), and their log-probabilities if asked for."""
        new, logprobs = self.output[self.reported :], self.logprobs[self.reported :]
        self.reported = len(self.output)
        return new, logprobs

    def cut_output(self, length: int) -> None:
        """Keep the first `length` output tokens and their log-probabilities: a stop string ended the reply
        inside a step that added several tokens (the caller then ends the sequence, freeing its blocks)."""
        del self.output[length:]
        del self.logprobs[length:]
        self.reported = min(self.reported, length)


def check_sequence(prompt_ids: list[int], params: SamplingParams, max_seq_len: int) -> None:
    """The engine's own limits (the handler's request rules come first and say more)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if params.max_new_tokens < (0 if params.prompt_logprobs is not None else 1):
        raise ValueError(f"max_new_tokens must be >= 1 (0 only with prompt_logprobs), got {params.max_new_tokens}")
    if len(prompt_ids) + params.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
            f"exceeds max_seq_len {max_seq_len}"
        )
    check_params(params)


def readmitted_hits(seq: Sequence, hits: list[int], size: int) -> list[int]:
    """The prefix cache's hits a sequence takes: a preempted one (readmitted, hitting its own freed blocks) not the
    last of them where they would leave its prompt's last token to a row of its own, which attends as a decode
    row (other bits in bfloat16 with heads of 64), when its first admission computed that token in a prompt row:
    its reply would change from there on."""
    if seq.cached_tokens is not None and len(hits) * size == len(seq.prompt_ids) - 1 > seq.cached_tokens:
        return hits[:-1]
    return hits


def prompt_chunk(seq: Sequence, budget: int, whole: bool = True) -> int:
    """How many of a prefilling sequence's next tokens its row takes, at most `budget`: a prompt's row ends at
    the prompt's end (a preempted sequence's reply follows in rows of its own, `Row.decoded`), and never takes
    all but one of the prompt, where it can take fewer and still not be alone, so the last token does not come
    to a row of its own. A row of one token attends as a decode row, whose bits are not prompt_attention.c's
    (bfloat16, heads of 64: docs/cpu-kernels.md), so a prompt cut there drew other tokens beside other requests
    than alone. A budget of 2 that would leave one takes none (0: the sequence waits for a later step) unless it
    is the step's `whole` budget (never a stall: the first prompt row gets the whole one); the scheduler hands out
    no budget of 1 but a step's whole one, which would put a token mid-prompt alone."""
    prompt = len(seq.prompt_ids)
    if seq.computed >= prompt:  # the reply's tokens attend as decode rows: any cut gives their bits
        return min(budget, len(seq.tokens) - seq.computed)
    left = prompt - seq.computed
    take = min(budget, left)
    if take == left - 1 == 2 and not whole:
        return 0
    return take - 1 if take == left - 1 and take > 2 else take
