"""The drafting phase of a round: free drafters' proposals, the chosen drafter's draft (a policy's stop rule may
end a model draft early), a free drafter continuing a model's draft, and the tree of branches a policy adds.

Free drafters' tokens must be deterministic (one-hot q): the engine cuts their proposals to the chosen length and
appends them to model drafts after seeing their tokens, which is unbiased only for deterministic tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .draft import Draft
from .drafters.base import Drafter, StoppableDrafter
from .outcome import Extension
from .policy import Policy
from .sampling import SamplingParams
from .tree import DraftTree


def free_proposals(
    pool: Sequence[Drafter], context: list[int], k: int, params: SamplingParams
) -> tuple[dict[int, Draft], dict[int, float]]:
    """Every free drafter's k-token proposal (microseconds each), for policies that choose or learn from them, and
    the seconds each took."""
    drafts, times = {}, {}
    if k <= 0:
        return drafts, times
    for arm, drafter in enumerate(pool):
        if not drafter.runs_model:
            start = time.perf_counter()
            drafts[arm] = deterministic(drafter, drafter.propose(context, k, params, None))
            times[arm] = time.perf_counter() - start
    return drafts, times


def chosen_draft(
    pool: Sequence[Drafter],
    policy: Policy | None,
    arm: int | None,
    k: int,
    context: list[int],
    proposals: dict[int, Draft],
    params: SamplingParams,
    generator: torch.Generator,
    stop_rules: bool,
) -> Draft:
    """Drafter `arm`'s draft of up to k tokens: its proposal cut to k when it made one this round, else drawn now,
    ended early by the policy's stop rule where the drafter takes one (stop_rules)."""
    if arm is None or k == 0:
        return Draft([])
    if arm in proposals:  # deterministic tokens: cutting them to the chosen length biases nothing
        return proposals[arm].truncated(k)
    drafter = pool[arm]
    stop = policy.stop_rule(arm, k) if stop_rules else None
    if stop is not None and isinstance(drafter, StoppableDrafter):
        draft = drafter.propose_until(context, k, params, generator, stop)
    else:
        draft = drafter.propose(context, k, params, generator)
    return draft if drafter.runs_model else deterministic(drafter, draft)


def continued_draft(
    pool: Sequence[Drafter],
    policy: Policy | None,
    arm: int | None,
    draft: Draft,
    context: list[int],
    room: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
) -> tuple[Draft, Extension | None]:
    """A model drafter's draft, continued by a free drafter where the policy finds it pays (`room` tokens in all at
    most): the free drafters propose for the context the model's tokens lead to (microseconds), and a copy that
    picks up there costs only its verification, nearly nothing where T(M) is flat. The proposals go to the policy
    even when none is appended: it learns what continuations are worth from all of them."""
    if (
        arm is None
        or not pool[arm].runs_model
        or not policy.extends
        or not draft.tokens
        or len(draft.tokens) >= room
        or eos_token_ids.intersection(draft.tokens)
    ):
        return draft, None
    after, _ = free_proposals(pool, context + draft.tokens, room - len(draft.tokens), params)
    choice = policy.extension(arm, draft, after)
    if choice is None:
        return draft, Extension(len(draft.tokens), None, after)
    free, n = choice
    return draft.followed_by(after[free].truncated(n)), Extension(len(draft.tokens), free, after)


def draft_tree(
    policy: Policy | None, arm: int | None, draft: Draft, proposals: dict[int, Draft], max_nodes: int
) -> DraftTree:
    """The round's draft tree: the chosen draft, and for a policy that grows trees the branches it adds (free
    proposals, a model draft's runners-up: deterministic tokens, tried after the drawn ones, so sampling stays
    exact), within max_nodes (the sizes T(M) is calibrated for)."""
    tree = DraftTree.chain(draft, arm)
    if arm is not None and policy.grows_trees:  # a plain step stays one
        for branch_arm, branch in policy.branches(tree, proposals, max_nodes):
            tree.add(branch_arm, branch)
    return tree


def deterministic(drafter: Drafter, draft: Draft) -> Draft:
    """A free drafter's draft, checked one-hot (see the module's docstring)."""
    if draft.q is not None:
        raise ValueError(
            f"drafter {drafter.name!r} is a free drafter (runs_model False) but returned q: a free drafter's "
            "proposals must be deterministic (Draft.q None), as they are cut and appended after their tokens are "
            "seen; give it runs_model = True to have its sampled drafts verified whole"
        )
    return draft
