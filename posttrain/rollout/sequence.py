"""A sequence (one sample of one request) and a prefill group (one prompt and the samples forked from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from itertools import count

_ids = count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids are synced from the engine's tensors only when the sequence joins, is preempted or
    finishes; while it runs, its progress is `num_tokens_at(step)` (one token per decode step)."""

    token_ids: list[int]  # prompt + completion so far
    prompt_len: int
    sample_index: int
    request: object = None  # the engine's per-request state (opaque here)
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    slot: int | None = None  # row in the engine's batch tensors
    join_step: int = 0  # decode step counter when it (re)joined the running set
    join_computed: int = 0
    epoch: int = 0  # bumped when preempted, invalidates pending block timers
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs of the completion (synced like token_ids)
    kept_counts: list[int] = field(default_factory=list)  # size of each token's kept set, 0 = untruncated (synced too)
    model_logprobs: list = field(default_factory=list)  # TokenLogprob per completion token, when the request asks (appended each step)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def computed_at(self, step: int) -> int:
        """Tokens with KV after `step` decode steps of the running set (each step computes one)."""
        return self.join_computed + (step - self.join_step)


@dataclass(eq=False)
class Group:
    """A prefill unit: the parent sequence is computed once; `size - 1` samples are forked from it.

    A new request with n samples becomes groups of at most the usable slots (max_num_seqs rounded
    down to a multiple of the scheduler's width); a preempted sequence comes
    back as a group of size 1 that continues its own sample."""

    parent: Sequence
    sample_indices: list[int]
    resume: bool = False

    @property
    def size(self) -> int:
        return len(self.sample_indices)
