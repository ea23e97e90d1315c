"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target).

In a batch, forks of one model drafter draft together (vLLM's batch-first proposers): each fork that drafts with
others gets a row of slots over the drafter's model (`slots.BatchedTarget`, the structure a batch's target
rows use), and every draft step is one forward over all of their rows. A fork drafting alone keeps its own
`CachedModel`; each cache takes in what it has not seen, so a fork may draft either way from round to round.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from ..cached_model import CachedModel, common_prefix, fit_vocab
from ..draft import Draft, DraftJob
from ..models.int8_weights import drafting_weights
from ..sampling import SamplingParams, pick, probabilities
from ..slots import BatchedTarget, check_batched_logits
from ..tree import DraftTree
from .base import AutoregressiveDrafter, DraftBuilder


class ModelDrafter(AutoregressiveDrafter):
    """`model` is kept as loaded (`self.model`); drafting runs `self.lm`, on an int8 twin of it where `weights`
    asks for one (`int8_weights`: `auto` = where measured faster). `self.weights` says which it got."""

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int, weights: str = "unquantized"):
        self.name = name
        self.model = model
        drafting, self.weights = drafting_weights(model, weights)
        self.lm = CachedModel(drafting, vocab_size=vocab_size)
        self.slots = SharedRows(drafting)  # shared by the forks: where they draft together
        self.row: tuple[int, object] | None = None  # (generation, row) there, once this fork drafted with others

    def begin(self, prompt: list[int]) -> None:
        self.lm.reset()

    def end(self, context: list[int]) -> None:
        """The request ended: its row, if it had one, is given back."""
        self.slots.release(self)

    def fork(self) -> ModelDrafter:
        """The same weights with a KV cache of its own (a batch gives each request one)."""
        twin = copy.copy(self)
        twin.lm = CachedModel(self.lm.model, vocab_size=self.lm.vocab_size)
        twin.row = None
        return twin

    def next_q(self, context: list[int], params: SamplingParams) -> Callable[[list[int]], torch.Tensor]:
        """logits_for() first catches the cache up on whatever context it has not seen (missed rounds, rejections)."""
        return lambda seq: probabilities(self.lm.logits_for(seq), params)[0]

    def batch_key(self) -> Hashable | None:
        """Forks of one model draft together, where the model decodes rows of slots as it decodes alone."""
        return id(self.slots) if self.slots.usable() else None

    @classmethod
    def draft_batch(cls, jobs: Sequence[DraftJob]) -> list[tuple[Draft, float]]:
        """Every job's draft with one forward per drafted token for all rows still drafting (charged evenly to
        them), after each row takes in the context it has not seen: alone when that is more than a step's few
        tokens (a prompt, missed rounds: charged to it), else inside the first step."""
        slots: SharedRows = jobs[0].drafter.slots
        rows = slots.rows_for([job.drafter for job in jobs])
        seqs = [list(job.context) for job in jobs]
        built = [DraftBuilder() for _ in jobs]
        seconds = [0.0] * len(jobs)
        for i, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
            if len(seq) - 1 - common_prefix(row.tokens, seq) > slots.CATCH_UP_IN_STEP:
                started = time.perf_counter()
                slots.target.prefill(row, seq)
                seconds[i] += time.perf_counter() - started
        for j in range(max(job.k for job in jobs)):
            drafting = [i for i, job in enumerate(jobs) if j < job.k]
            started = time.perf_counter()
            logits = slots.target.forward([(rows[i], seqs[i], DraftTree()) for i in drafting])
            for i, after in zip(drafting, logits, strict=True):
                job = jobs[i]
                q = probabilities(fit_vocab(after[:1], job.drafter.lm.vocab_size), job.params)[0]
                built[i].forwards += 1
                built[i].add(q, pick(q, job.params, job.generator))
                seqs[i].append(built[i].tokens[-1])
            for i in drafting:
                seconds[i] += (time.perf_counter() - started) / len(drafting)
        return [(b.draft(), t) for b, t in zip(built, seconds, strict=True)]


class SharedRows:
    """The rows of slots that forks of one model drafter draft together in: a `BatchedTarget` over the drafting
    model, made at the first batched draft, a row per fork (given back at its request's end), made anew with more
    rows (every row's cache dropped: each catches up again) when more forks draft together than it has rows.
    `usable` is False for a model the slots do not decode as it decodes alone (`check_batched_logits`): its forks
    then draft one by one."""

    CATCH_UP_IN_STEP = 4  # unseen tokens a row takes in inside the first draft step; more are prefilled alone first

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.target = None
        self.generation = 0  # bumped when the rows are made anew: a fork's row of an older generation is gone
        self._usable: bool | None = None

    def usable(self) -> bool:
        """Whether this model decodes through rows of slots as it does alone (checked once)."""
        if self._usable is None:
            try:
                check_batched_logits(self.model)
                self._usable = True
            except ValueError:
                self._usable = False
        return self._usable

    def rows_for(self, forks: Sequence[ModelDrafter]) -> list:
        """Each fork's row: its own from earlier rounds, else a free one; if too few are free, all anew."""
        missing = [fork for fork in forks if not self._holds(fork)]
        if missing and (self.target is None or self.target.active + len(missing) > len(self.target.rows)):
            size = max(8, 2 * len(forks), 0 if self.target is None else len(self.target.rows))
            self.target, self.generation = BatchedTarget(self.model, rows=size), self.generation + 1
            missing = list(forks)
        for fork in missing:
            fork.row = (self.generation, self.target.add_row())
        return [fork.row[1] for fork in forks]

    def release(self, fork: ModelDrafter) -> None:
        """The fork's request ended: its row is free for another."""
        if self._holds(fork):
            self.target.remove_row(fork.row[1])
        fork.row = None

    def _holds(self, fork: ModelDrafter) -> bool:
        return fork.row is not None and fork.row[0] == self.generation
