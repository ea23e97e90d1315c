"""A drafter that runs a causal LM autoregressively with its own KV cache (a small LM, or a truncated target).

In a batch, forks of one model drafter draft together (vLLM's batch-first proposers): each fork that drafts with
others gets a row of slots over the drafter's model (`slots.BatchedTarget`, the structure a batch's target
rows use), and every draft step is one forward over all of their rows. A fork drafts from its own `CachedModel`
until it first drafts with others, and from its row after that, alone too: one cache per request at any time,
which takes in what it has not seen.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch

from ..cached_model import CachedModel
from ..draft import Draft, DraftJob
from ..models.int8_weights import drafting_weights
from ..models.loading import context_length
from ..models.logits import fit_vocab
from ..sampling import SamplingParams, pick, probabilities
from ..slots import BatchedTarget, Row, check_batched_logits
from ..tokens import common_prefix
from ..tree import DraftTree
from .base import AutoregressiveDrafter, DraftBuilder

log = logging.getLogger(__name__)


class ModelDrafter(AutoregressiveDrafter):
    """`model` is kept as loaded (`self.model`); drafting runs `self.lm`, on an int8 twin of it where `weights`
    asks for one (`int8_weights`: `auto` = where measured faster). `self.weights` says which it got. A fork that has
    drafted with others drafts from its row from then on, alone too: one cache per request, whose lag the engine
    counts."""

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int, weights: str = "unquantized"):
        self.name = name
        self.model = model
        drafting, self.weights = drafting_weights(model, weights)
        self.lm = CachedModel(drafting, vocab_size=vocab_size)
        self.slots = SharedRows(model)  # shared by the forks: where they draft together
        self.row: tuple[int, Row] | None = None  # (generation, row) there, once this fork drafted with others

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
        """Each call first catches the cache (its row, once it has one) up on whatever it has not seen (missed
        rounds, rejections); a sequence past the rows' context (a drafter with a shorter one than the target's)
        goes through its own cache, as it would have without rows."""

        def q(seq: list[int]) -> torch.Tensor:
            if self.slots.holds(self) and len(seq) <= self.slots.context:
                logits = self.slots.logits(self.row[1], seq, self.lm.vocab_size)
            else:
                logits = self.lm.logits_for(seq)
            return probabilities(logits, params)[0]

        return q

    def batch_key(self) -> Hashable | None:
        """Forks of one model draft together, where the model decodes rows of slots as it decodes alone."""
        return id(self.slots) if self.slots.usable() else None

    @classmethod
    def draft_batch(cls, jobs: Sequence[DraftJob]) -> list[tuple[Draft, float]]:
        """Every job's draft with one forward per drafted token for all rows still drafting (charged evenly to
        them), after each row takes in the context it has not seen: alone when that is more than a step's few
        tokens (a prompt, missed rounds: charged to it), else inside the first step. A job whose draft would reach
        past the drafting model's context drafts alone, as it would in a round of its own."""
        slots: SharedRows = jobs[0].drafter.slots
        out: list[tuple[Draft, float] | None] = [None] * len(jobs)
        fits = [i for i, job in enumerate(jobs) if len(job.context) + job.k <= slots.context]
        past = [i for i in range(len(jobs)) if i not in fits]
        for i, alone in zip(past, super().draft_batch([jobs[i] for i in past]), strict=True):
            out[i] = alone
        row_of = dict(zip(fits, slots.rows_for([jobs[i].drafter for i in fits]), strict=True))
        seqs = {i: list(jobs[i].context) for i in fits}
        built = {i: DraftBuilder() for i in fits}
        seconds = dict.fromkeys(fits, 0.0)
        unseen = {i: len(seqs[i]) - common_prefix(row.tokens, seqs[i]) for i, row in row_of.items()}
        for i, row in row_of.items():
            if unseen[i] - 1 > slots.CATCH_UP_IN_STEP:
                started = time.perf_counter()
                slots.target.prefill(row, seqs[i])
                seconds[i] += time.perf_counter() - started
        for j in range(max((jobs[i].k for i in fits), default=0)):
            drafting = [i for i in fits if j < jobs[i].k]
            started = time.perf_counter()
            logits = slots.target.forward([(row_of[i], seqs[i], DraftTree()) for i in drafting])
            for i, after in zip(drafting, logits, strict=True):
                job = jobs[i]
                q = probabilities(fit_vocab(after[:1], job.drafter.lm.vocab_size), job.params)[0]
                built[i].forwards += 1
                built[i].add(q, pick(q, job.params, job.generator))
                seqs[i].append(built[i].tokens[-1])
            for i in drafting:
                seconds[i] += (time.perf_counter() - started) / len(drafting)
        for i in fits:  # what its row took in: all of its context where the row is new (the engine counts less)
            out[i] = (dataclasses.replace(built[i].draft(), taken_in=unseen[i]), seconds[i])
        return out


class SharedRows:
    """The rows of slots that forks of one model drafter draft together in: a `BatchedTarget` over the model as
    loaded (float weights, as an EAGLE head's several-row steps run: an int8 twin is for one-row steps), made at
    the first batched draft, a row per fork (given back at its request's end, or when the fork is collected), made
    anew with twice the rows (every row's cache dropped: each catches up again) when too few are free. `usable` is
    False for a model the slots do not decode as it decodes alone (`check_batched_logits`): its forks then draft
    one by one."""

    CATCH_UP_IN_STEP = 4  # unseen tokens a row takes in inside the first draft step; more are prefilled alone first

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.target: BatchedTarget | None = None
        self.context = context_length(model.config)  # the largest position + 1 a row may use
        self.generation = 0  # bumped when the rows are made anew: a fork's row of an older generation is gone
        self._holders: weakref.WeakSet = weakref.WeakSet()  # forks holding a row of this generation
        self._usable: bool | None = None

    def usable(self) -> bool:
        """Whether this model decodes through rows of slots as it does alone (checked once; a model that fails
        the check in any way drafts one request after another)."""
        if self._usable is None:
            try:
                check_batched_logits(self.model)
                self._usable = True
            except Exception as err:  # noqa: BLE001 - any failure means: draft one by one
                log.info("forks of %s draft one by one: %s", type(self.model).__name__, err)
                self._usable = False
        return self._usable

    def holds(self, fork: ModelDrafter) -> bool:
        """Whether the fork holds a row of the rows in use."""
        return fork.row is not None and fork.row[0] == self.generation

    def rows_for(self, forks: Sequence[ModelDrafter]) -> list[Row]:
        """Each fork's row: its own from earlier rounds, else a free one; if too few are free, all anew."""
        missing = [fork for fork in forks if not self.holds(fork)]
        if missing and (self.target is None or self.target.active + len(missing) > len(self.target.rows)):
            held = 0 if self.target is None else self.target.active
            for fork in list(self._holders):
                fork.row = None
            self._holders = weakref.WeakSet()
            self.target = BatchedTarget(self.model, rows=max(8, 2 * (held + len(missing))))
            self.generation += 1
            missing = list(forks)
        for fork in missing:
            row = self.target.add_row()
            fork.row = (self.generation, row)
            fork.lm.reset()  # its own cache is not read again: its row is its cache
            self._holders.add(fork)
            weakref.finalize(fork, _free_row, weakref.ref(self), self.generation, weakref.ref(row))
        return [fork.row[1] for fork in forks]

    def logits(self, row: Row, seq: list[int], vocab_size: int) -> torch.Tensor:
        """The logits [1, V] after `seq` from one row alone (a fork drafting in a round of its own)."""
        return fit_vocab(self.target.forward([(row, seq, DraftTree())])[0][:1], vocab_size)

    def release(self, fork: ModelDrafter) -> None:
        """The fork's request ended: its row is free for another."""
        if self.holds(fork):
            self._free(self.generation, fork.row[1])
            self._holders.discard(fork)
        fork.row = None

    def _free(self, generation: int, row: Row) -> None:
        if generation == self.generation and row.index >= 0:
            self.target.remove_row(row)


def _free_row(slots: weakref.ref, generation: int, row: weakref.ref) -> None:
    """A collected fork's row, given back if its rows are still in use (weak references only: a fork's finalizer
    keeps neither the rows nor their slots alive)."""
    shared, held = slots(), row()
    if shared is not None and held is not None:
        shared._free(generation, held)
