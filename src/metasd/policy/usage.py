"""How much of a request's output a model drafter yields once it has started: what its prompt prefill is charged by.

A model drafter's first draft in a request prefills the prompt into its own cache, which on a long prompt costs
several target steps. `metasd-adaptive` charges that prefill to a round in proportion to the round's share of the
tokens the drafter is expected to yield in the rest of the request (`AdaptivePolicy._model_option`). This module
keeps that expectation: per drafter, across requests, the share of a request's output from the drafter's first draft
on that came from its own rounds, as a mean shrunk toward 1.
"""

from __future__ import annotations

PRIOR = 1.0  # pseudo-requests at full usage: an unknown drafter is priced as if it would yield everything


class PrefillUsage:
    """Per model drafter: the mean share of a request's output (from its first draft on) its own rounds yielded."""

    def __init__(self, n_arms: int) -> None:
        self.n_arms = n_arms
        self.sums = [0.0] * n_arms  # across requests: the shares observed
        self.counts = [0] * n_arms  # and how many requests they came from
        self._since_start: list[float | None] = [None] * n_arms  # this request: tokens since its first draft
        self._yielded = [0.0] * n_arms  # and tokens its own rounds emitted

    def count(self, arm: int | None, tokens: int, *, model: bool) -> None:
        """A round emitted `tokens`; `arm` drafted it (None: a plain step), a model drafter if `model`."""
        for a, since in enumerate(self._since_start):
            if since is not None:
                self._since_start[a] = since + tokens
        if arm is not None and model:
            if self._since_start[arm] is None:
                self._since_start[arm] = tokens
            self._yielded[arm] += tokens

    def finish(self) -> None:
        """The request ended: record the share each started drafter's rounds yielded."""
        for arm, since in enumerate(self._since_start):
            if since:
                self.sums[arm] += self._yielded[arm] / since
                self.counts[arm] += 1
        self._since_start = [None] * self.n_arms
        self._yielded = [0.0] * self.n_arms

    def forget(self, arm: int) -> None:
        """What was recorded of drafter `arm` across requests (another drafter now drafts under its index)."""
        self.sums[arm], self.counts[arm] = 0.0, 0

    def share(self, arm: int) -> float:
        """The expected share of a request's output drafter `arm` yields once started: the mean over earlier
        requests with one pseudo-request at 1 (so a single poor request does not shut it out of the next)."""
        return (self.sums[arm] + PRIOR) / (self.counts[arm] + PRIOR)
