"""One request in flight (`Generation`): its phases of a round (MetaSD, arXiv 2604.05417) — `start_round` (the draft
room, the drafters' lags, free proposals), `choose` (its policy's drafter and k), `draft` (`metasd.drafting`) and
`accept` (the acceptance rule, the policy's reward, the costs measured, the statistics) — around the target forward
that `round.run_round` makes for one request or a batch; and its life: `begin`, iteration, `finish`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import GenerationConfig

from .cached_model import TargetCache
from .costs import CostModel, observe_round, reward_times
from .draft import Draft, DraftJob
from .drafters import Drafter
from .drafting import chosen_draft, continued_draft, draft_tree, free_proposals
from .models.loading import LoadedModel
from .outcome import RoundOutcome
from .policy import Policy
from .processors import process, target_processors
from .round import OwnChoice, RoundClock, RoundState, run_round
from .sampling import SamplingParams
from .stats import GenerationResult, GenerationStats, Round
from .tokens import common_prefix, token_ids
from .verify import verify_round

OWN_CHOICE = OwnChoice()


class Host(Protocol):
    """What a request reads of the decoder that started it (`engine.Decoder`)."""

    target: LoadedModel
    target_cache: TargetCache  # the verifier's cache when the request decodes alone
    draft_len: int  # the longest draft when its policy sets none
    policy_scope: str  # "request": its policy starts afresh

    @property
    def costs(self) -> CostModel | None: ...

    def decode(self, token_ids: list[int]) -> str: ...


class Generation:
    """One request in flight; iterate it to decode, stop iterating to abandon it. Its target is the decoder's cache,
    or a row of a batch (`metasd.batching`), which drives the same phases."""

    def __init__(
        self,
        decoder: Host,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        policy: Policy | None,
        pool: list[Drafter],
        generation_config: GenerationConfig | None = None,
    ):
        self.decoder = decoder
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.policy = policy
        self.pool = pool
        self.target: TargetCache = decoder.target_cache  # its handle in the verifier's cache (a batch gives a row)
        self.token_ids: list[int] = []
        self.context = list(prompt)
        self.finish_reason = "length"
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.max_draft = (policy.max_draft if policy is not None else None) or decoder.draft_len
        self._drafted: set[str] = set()  # drafters that drafted in this request (their caches hold the prompt)
        self._synced: dict[str, int] = {}  # context length each model drafter's cache has seen
        self._generator = torch.Generator()
        self._started: float | None = None
        self._finished = False
        # the logits processors the target's generation config makes its own generate() apply (None: none)
        model, spec = decoder.target.model, decoder.target.spec
        self.processors = target_processors(model, len(prompt), max_new_tokens, spec, generation_config)
        eos = None if generation_config is None else generation_config.eos_token_id
        self.eos_token_ids = decoder.target.eos_token_ids if eos is None else frozenset(token_ids(eos))
        self._iter = self._rounds()

    def __iter__(self) -> Iterator[list[int]]:
        return self._iter

    def close(self) -> None:
        """Abandon the request now rather than whenever it is garbage-collected: the drafters see its end."""
        self._iter.close()
        self.finish()

    def result(self) -> GenerationResult:
        """The request's text, tokens, statistics and finish reason so far."""
        return GenerationResult(
            self.decoder.decode(self.token_ids), list(self.token_ids), self.stats, self.finish_reason
        )

    @property
    def started(self) -> bool:
        """Whether the request has begun (its caches and drafters set up)."""
        return self._started is not None

    @property
    def done(self) -> bool:
        """Whether the request has all its tokens or met an end-of-sequence token."""
        return len(self.token_ids) >= self.max_new_tokens or self.finish_reason == "stop"

    def begin(self) -> None:
        """The request starts: its sampling generator, the target's cache, the drafters and the policy."""
        if self.params.seed is not None:
            self._generator.manual_seed(self.params.seed)
        else:
            self._generator.seed()
        self.target.reset()
        for drafter in self.pool:
            drafter.begin(self.prompt)
        if self.policy is not None:
            self.policy.revise([d.revision() for d in self.pool])
            if self.decoder.policy_scope == "request":
                self.policy.reset()
        self._synced = {d.name: 0 for d in self.pool}
        self._started = time.perf_counter()

    def finish(self) -> None:
        """The request ended (or was abandoned): what was generated is real output, for the policy and drafters."""
        if self._finished or not self.started:
            return
        self._finished = True
        with contextlib.ExitStack() as ends:  # each runs (a model drafter gives its row back) even if another raises
            for end in reversed(([self.policy.finish] if self.policy is not None else []) + [d.end for d in self.pool]):
                ends.callback(end, self.context)

    def _rounds(self) -> Iterator[list[int]]:
        self.begin()
        try:
            while not self.done:
                yield self.step()
        finally:  # also when the consumer stops early
            self.finish()

    def step(self) -> list[int]:
        """One round on its own (`round.run_round` for a batch of one): choose, draft, verify, learn. Returns the
        tokens it added to the context."""
        return run_round([self], self.decoder.target_cache, OWN_CHOICE)[0]

    @property
    def room(self) -> int:
        """The longest draft the next round may verify (max_draft, and the tokens still wanted)."""
        return min(self.max_draft, self.max_new_tokens - len(self.token_ids) - 1)

    def start_round(self, propose: bool = True) -> RoundState:
        """What a round starts from: the draft room, the drafters' lags, and the free drafters' proposals (for a
        policy that wants them, unless the round will not draft: propose False)."""
        clock = RoundClock()
        remaining = self.max_new_tokens - len(self.token_ids)
        # tokens each model drafter must take in before drafting: the prompt on its first draft, then what it missed
        lags = [len(self.context) - self._synced[d.name] if d.runs_model else 0 for d in self.pool]
        fresh = [d.runs_model and d.name not in self._drafted for d in self.pool]
        wants = propose and self.policy is not None and self.policy.wants_proposals
        proposals, times = free_proposals(self.pool, self.context, self.room, self.params) if wants else ({}, {})
        return RoundState(clock, self.room, remaining, lags, fresh, proposals, times)

    def choose(self, state: RoundState) -> None:
        """The policy's (drafter, k) for a request decoding alone."""
        if self.policy is not None and state.room > 0:
            state.arm, state.k = self.policy.choose(
                state.room, state.proposals, state.lags, remaining=state.remaining, fresh=state.fresh
            )

    def draft_job(self, state: RoundState) -> DraftJob | None:
        """The draft asked of its model drafter, for a batch to draft beside others' (None: none, or a free one's)."""
        arm = state.arm
        free = arm is None or state.k == 0 or arm in state.proposals or not self.pool[arm].runs_model
        return None if free else DraftJob(self.pool[arm], self.context, state.k, self.params, self._generator)

    def draft(self, state: RoundState, stop_rules: bool = True, drafted: tuple[Draft, float] | None = None) -> None:
        """The chosen drafter drafts (its stop rule may end it early: stop_rules; or a batch `drafted` it, with the
        seconds this request is charged), a free drafter may continue it, a tree may grow (`metasd.drafting`)."""
        pool, policy, params, arm = self.pool, self.policy, self.params, state.arm
        if drafted is None:
            started = time.perf_counter()
            draft = chosen_draft(
                pool, policy, arm, state.k, self.context, state.proposals, params, self._generator, stop_rules
            )
            drafted = (draft, time.perf_counter() - started)
        draft, seconds = drafted  # in a batch, the clock's drafting span is what this request is charged
        state.clock.drafted = time.perf_counter()
        state.clock.chosen = state.clock.drafted - seconds
        state.draft, state.extension = continued_draft(
            pool, policy, arm, draft, self.context, state.room, params, self.eos_token_ids
        )
        max_nodes = self.decoder.costs.target.max_tokens - 1  # (calibrated when the decoder was built)
        state.tree = draft_tree(policy, arm, state.draft, state.proposals, max_nodes)

    def accept(self, state: RoundState, logits: torch.Tensor, prefilled: bool, alone: bool) -> list[int]:
        """The acceptance rule on the target's logits for the round's tree, then the policy learns, the costs are
        measured and the statistics record the round. prefilled: the forward also took in the prompt; alone: it
        verified this request only (then it measures T(M); a batch's forward measures the batch's costs). Returns
        the tokens added."""
        clock, tree, draft, arm = state.clock, state.tree, state.draft, state.arm
        clock.accepting = time.perf_counter()
        if self.processors is not None:  # each row as generate processes it after the context and its path
            logits = process(self.processors, logits, self.context, tree.prefixes())
        verdict, p = verify_round(logits, tree, self.params, self._generator)
        clock.verified = time.perf_counter()
        path = tree.path_tokens(verdict.path)
        new = self._emit(path + [verdict.next_token])
        accepted = common_prefix(draft.tokens, path)  # of the chosen drafter's draft
        start = len(self.context)
        self.context += new
        self.token_ids += new
        drafter = self.pool[arm] if arm is not None else None
        fresh = drafter.name if drafter is not None and state.fresh[arm] else None
        outcome = RoundOutcome(
            arm=arm,
            k=state.k,
            draft=draft,
            accepted=accepted,
            start=start,
            context=self.context,
            p=p,
            target_tokens=verdict.target_tokens,
            proposals=state.proposals,
            extension=state.extension,
            tree_accepted=None if len(tree.branches) == 1 else len(path),
            **reward_times(
                self.decoder.costs,
                clock,
                state.proposal_times.get(arm, 0.0),
                state.forward,
                prefilled,
                fresh,
                draft.forwards,
            ),
        )
        score = self.policy.feedback(outcome) if self.policy is not None else None
        if drafter is not None and drafter.runs_model and draft.forwards:  # (no forward: it took nothing in) its
            # cache holds the context it drafted from and, if it keeps its draft, forwards - 1 of its tokens
            kept = min(draft.forwards - 1, accepted) if drafter.keeps_its_draft else 0
            self._synced[drafter.name] = start + kept
            self._drafted.add(drafter.name)
        clock.finished = time.perf_counter()
        taken_in = draft.taken_in if draft.taken_in is not None else state.lags[arm] if arm is not None else 0
        observe_round(
            self.decoder.costs,
            clock,
            "greedy" if self.params.greedy else "sampled",
            tree.size,
            unmeasured=prefilled or not alone,
            drafter=drafter.name if drafter is not None and arm not in state.proposals else None,
            forwards=draft.forwards,
            taken_in=taken_in,
        )
        self._record(state, outcome, score, new, len(path), taken_in)
        return new

    def _record(
        self, state: RoundState, outcome: RoundOutcome, score: float | None, new: list[int], path: int, taken_in: int
    ) -> None:
        """The round in the request's statistics."""
        clock, draft, arm, accepted = state.clock, state.draft, state.arm, outcome.accepted
        draft_time = state.proposal_times.get(arm, 0.0) + clock.draft_seconds
        extension = state.extension
        self.stats.rounds.append(
            Round(
                drafter=self.pool[arm].name if arm is not None else None,
                drafted=len(draft.tokens),
                accepted=min(accepted, len(new)),
                reward=score,
                catch_up=taken_in - len(self.prompt) if arm is not None and state.fresh[arm] else taken_in,  # no prompt
                draft_time=draft_time,
                verify_time=clock.verify_seconds,
                policy_time=clock.total_seconds - draft_time - clock.verify_seconds,
                emitted=len(new),
                chosen_k=state.k,
                extended=len(draft.tokens) - outcome.own,
                continued_by=self.pool[extension.arm].name if extension and extension.arm is not None else None,
                branch_nodes=state.tree.size - len(draft.tokens),
                branch_accepted=max(min(path, len(new)) - min(accepted, len(new)), 0),
            )
        )
        self.stats.new_tokens = len(self.token_ids)
        self.stats.wall_time = time.perf_counter() - self._started

    def _emit(self, verified: list[int]) -> list[int]:
        """What the output takes of a round's tokens: up to max_new_tokens, and up to an end-of-sequence token."""
        new = verified[: self.max_new_tokens - len(self.token_ids)]
        stop = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
        if stop is not None:
            self.finish_reason = "stop"
            return new[: stop + 1]
        return new
