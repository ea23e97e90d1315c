"""What one round did, as the engine hands it to the policy that chose it (each policy takes what it learns from)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .draft import Draft


@dataclass(frozen=True)
class Extension:
    """What followed a model drafter's draft: every free drafter's proposal for the context its tokens lead to,
    and which one, if any, the round verified after them."""

    start: int  # drafted tokens that came from the chosen drafter; a continuation follows them
    arm: int | None  # the free drafter whose proposal was appended (None: none was)
    proposals: Mapping[int, Draft]  # what every free drafter proposed for context + the model's tokens


@dataclass(frozen=True)
class RoundOutcome:
    """One verified round: who drafted what, how much of it was accepted, the context it left, the target's view of
    the drafted positions, and its times in seconds (`draft_time`, `verify_time`)."""

    arm: int | None  # the drafter that drafted (None: a plain target step)
    k: int  # the draft length the round allowed (what rewards divide by)
    draft: Draft
    accepted: int  # tokens of `draft` the acceptance rule kept (before any end-of-sequence cut)
    start: int  # output position of the first drafted token = context length before the round
    context: list[int]  # the whole context after the round (prompt + output so far)
    p: torch.Tensor | None  # target probabilities at the drafted positions + 1 (sampling only)
    target_tokens: list[int] | None  # the target's argmax at those positions (greedy only)
    proposals: Mapping[int, Draft]  # what every free drafter proposed this round (when the policy asked)
    draft_time: float
    verify_time: float
    plain_step_time: float  # the machine's current estimate of a 1-token target step (0 when not measured)
    extension: Extension | None = None  # a model's draft: the continuations offered, and tokens appended from
    # `extension.start` on
    tree_accepted: int | None = None  # a tree round: tokens accepted along the path, whichever branches held them

    @property
    def gained(self) -> int:
        """Drafted tokens the round kept: along the tree's path, or of the draft when it was verified alone."""
        return self.accepted if self.tree_accepted is None else self.tree_accepted

    @property
    def own(self) -> int:
        """Drafted tokens that came from the chosen drafter itself."""
        return len(self.draft.tokens) if self.extension is None else self.extension.start
