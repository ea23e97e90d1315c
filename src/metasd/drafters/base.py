"""The drafter interface: propose up to k tokens for the current context, with q or without (then q is one-hot)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..draft import Draft, DraftJob
from ..sampling import SamplingParams, pick


class StopRule(Protocol):
    """How a policy ends a model drafter's draft early, asked twice per token j:

    - `before(j, q_j)`: q_j computed (that forward is paid), token j not yet drawn: is it worth verifying?
    - `after(j, q_j, token)`: token j drawn: is another drafter forward, for token j + 1, worth paying for?

    Neither may drop a drawn token, so the draft stays a sample of q and sampled verification stays exact: `before`
    decides on q_j alone, and `after` only ends the draft *after* token j (a stopping time, which the acceptance
    rule does not care about), while a cut that looked at a drawn token and dropped it would favour tokens the
    drafter liked.
    """

    def before(self, j: int, q: torch.Tensor) -> bool: ...
    def after(self, j: int, q: torch.Tensor, token: int) -> bool: ...


@runtime_checkable
class StoppableDrafter(Protocol):
    """A drafter that lets a `StopRule` end its draft early."""

    def propose_until(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, stop: StopRule
    ) -> Draft:
        """Up to k tokens, as `propose` drafts them, ended early where `stop` says so."""
        ...


class Drafter:
    """Base class of every drafter: `propose` up to k tokens for the current context (with the q they were drawn
    from, or none: then they are deterministic, one-hot). Everything else has a default here, and a drafter
    declares what it can do by overriding it:

    - `runs_model`: a model drafter (a forward per drafted token and a KV cache of its own, which must take in the
      tokens of rounds it sat out: the engine counts that lag); False: a free drafter (a lookup costing
      microseconds, whose proposals are deterministic and may be cut to any length or appended to a model's draft).
    - `keeps_its_draft`: a model drafter's cache keeps the tokens it drafted, so those a round accepts are not taken
      in again; False: it drops them (an EAGLE head: its draft entries came from predicted features, and the
      accepted tokens' true ones arrive with the verification), and takes in every token since the context it
      last drafted from.
    - `reads_target_features` / `feature_layers`: it drafts from the target's features (EAGLE heads); the target's
      cache keeps them, with the outputs of `feature_layers` (EAGLE-3's fused features), and hands them over
      through `read_features_from`.
    - `learns_across_requests`: `end` teaches it something the next request drafts from (the suffix drafter
      indexes outputs); the benchmark snapshots exactly these drafters so that every method meets the same history
      (bench/history.py): the others may hold unpicklable shared state, such as a datastore's memory maps.
    - `fork`: its copy for one request among several in flight (a batch).
    - `use_history`: which cross-request history the next requests read and extend (a key per client, or None).
    - `revision`: what the next request drafts with, where that can change between requests (an EAGLE head learned
      from traffic and swapped in, or another history key's head): a policy forgets what it carried across
      requests of a drafter whose revision changed, since it describes another drafter.
    - `batch_key` / `draft_batch`: forks whose drafts can share forwards in a batch (the same weights) say so, and
      draft together: one forward per drafted token for all of them (vLLM's batch-first proposers).
    """

    name: str
    runs_model: bool = False
    keeps_its_draft: bool = True
    reads_target_features: bool = False
    feature_layers: tuple[int, ...] = ()
    learns_across_requests: bool = False

    def begin(self, prompt: list[int]) -> None:
        """A new request starts from this prompt."""

    def end(self, context: list[int]) -> None:
        """The request ended (finished or abandoned) with this context: prompt + every generated token.

        Drafters that learn across requests index the output here, not only the part they happened to draft on.
        """

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        """Up to k tokens to follow context (fewer or none is allowed), drawn under params."""
        raise NotImplementedError

    def fork(self) -> Drafter:
        """The drafter for one request among several in flight (a batch): its own per-request state (`begin` makes
        it), the weights and what it learns across requests shared. A drafter with more per-request state than
        `begin` rebuilds (a model drafter's KV cache) overrides this shallow copy."""
        return copy.copy(self)

    def read_features_from(self, target) -> None:
        """Where the target's features come from (a `CachedModel` or a batch's row): drafters that read them."""
        raise TypeError(f"drafter {self.name!r} does not read the target's features")

    def use_history(self, key: str | None) -> None:
        """Which history the next requests read and extend; a drafter that keeps none has nothing to choose."""

    def revision(self) -> Hashable:
        """What the next request drafts with, where that can be replaced between requests (a head learned from
        traffic swapped in); equal values draft alike. A drafter that is never replaced has one revision."""
        return None

    def batch_key(self) -> Hashable | None:
        """Forks returning equal keys draft together in a batch (`draft_batch`); None: this one drafts alone."""
        return None

    @classmethod
    def draft_batch(cls, jobs: Sequence[DraftJob]) -> list[tuple[Draft, float]]:
        """The drafts of jobs whose drafters share a `batch_key`, as `propose` would draft each one (no stop rule),
        each with the seconds it is charged: here one after another; a drafter that shares forwards overrides
        this."""
        out = []
        for job in jobs:
            started = time.perf_counter()
            draft = job.drafter.propose(job.context, job.k, job.params, job.generator)
            out.append((draft, time.perf_counter() - started))
        return out


class DraftBuilder:
    """A model drafter's draft as its tokens are drawn, one q at a time: each token's confidence is the largest
    probability of its q (for greedy drafting, that of the token itself), its runner-up the likeliest other token."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.confidence: list[float] = []
        self.runners_up: list[tuple[int, float]] = []
        self.forwards = 0

    def add(self, q: torch.Tensor, token: int) -> None:
        """Token `token`, drawn from q."""
        self.tokens.append(token)
        self.rows.append(q)
        self.confidence.append(float(q.max()))
        top = torch.topk(q, 2)
        second = 1 if int(top.indices[0]) == token else 0
        self.runners_up.append((int(top.indices[second]), float(top.values[second])))

    def draft(self) -> Draft:
        """The draft so far, with the q of each token and the forwards paid (one may have drawn no token)."""
        q = torch.stack(self.rows) if self.rows else None
        return Draft(self.tokens, q, self.confidence, self.forwards, self.runners_up)


def draft_autoregressively(
    next_q: Callable[[list[int]], torch.Tensor],
    context: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop: StopRule | None,
) -> Draft:
    """A model drafter's draft: up to k tokens, each drawn from next_q(sequence so far), one forward per call; the
    stop rule may end it before token j is drawn or after it (`StopRule`)."""
    seq, built = list(context), DraftBuilder()
    for j in range(k):
        q = next_q(seq)
        built.forwards += 1
        if stop is not None and stop.before(j, q):
            break
        seq.append(pick(q, params, generator))
        built.add(q, seq[-1])
        if stop is not None and j + 1 < k and stop.after(j, q, seq[-1]):
            break
    return built.draft()


class AutoregressiveDrafter(Drafter):
    """A model drafter: one forward per drafted token, each token drawn from the q its `next_q` computes; the
    engine's policy may stop it early (`StoppableDrafter`). Subclasses set `name` and implement `begin`, `next_q`."""

    runs_model = True

    def next_q(self, context: list[int], params: SamplingParams) -> Callable[[list[int]], torch.Tensor] | None:
        """For a draft after `context`: a function from the sequence so far to the next token's q (one forward per
        call), or None when no draft can be made now."""
        raise NotImplementedError

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        return self.propose_until(context, k, params, generator, None)

    def propose_until(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop: StopRule | None,
    ) -> Draft:
        """Up to k tokens from `next_q`, ended early where `stop` says so (`draft_autoregressively`)."""
        next_q = self.next_q(context, params)
        if next_q is None:
            return Draft([], None, [], 0)
        return draft_autoregressively(next_q, context, k, params, generator, stop)
