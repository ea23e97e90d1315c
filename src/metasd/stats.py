"""Per-round records and the per-request summary the CLI, server and benchmark report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class Round:
    """One target forward. Counts are of what was emitted: on the last round the end-of-sequence token or
    max_new_tokens can cut accepted tokens (and the target's own token) off, and those are not counted."""

    drafter: str | None  # None: a plain target step (policy `none`, or a policy that chose k = 0)
    drafted: int
    accepted: int  # tokens of the chosen draft emitted
    reward: float | None
    catch_up: int  # context tokens this drafter had missed while others drafted
    draft_time: float
    verify_time: float
    policy_time: float  # choose + proposals for hindsight + feedback
    emitted: int  # tokens this round added to the output: accepted + branch_accepted + the target's own, unless cut
    chosen_k: int | None = None  # the length the policy asked for; drafted is shorter when a proposal runs out
    extended: int = 0  # drafted tokens a free drafter appended to a model drafter's draft (`Extension`)
    continued_by: str | None = None  # that free drafter
    branch_nodes: int = 0  # tree nodes verified beside the chosen draft (other drafters' branches)
    branch_accepted: int = 0  # tokens emitted from those branches beyond the chosen draft's accepted ones

    @property
    def own(self) -> int:
        """Drafted tokens that came from the drafter itself (`RoundOutcome.own`)."""
        return self.drafted - self.extended


@dataclass
class DrafterStats:
    """One drafter's totals over a request: rounds it drafted (`pulls`), tokens it drafted and had accepted, and
    the sum of its rewards."""

    pulls: int = 0
    drafted: int = 0
    accepted: int = 0
    reward_sum: float = 0.0

    @property
    def mean_reward(self) -> float:
        """The drafter's mean reward per round it drafted (0 before any)."""
        return self.reward_sum / self.pulls if self.pulls else 0.0


@dataclass
class GenerationStats:
    """One request's statistics: its prompt and new tokens, its wall time in seconds, and every round's record."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time: float = 0.0
    rounds: list[Round] = field(default_factory=list)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens gained per target forward (accepted + the target's own token), as vLLM counts."""
        return sum(r.emitted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time."""
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def switches(self) -> int:
        """How often the drafting drafter changed from one drafted round to the next (plain steps skipped)."""
        names = [r.drafter for r in self.rounds if r.drafter is not None]
        return sum(a != b for a, b in pairwise(names))

    @property
    def catch_up_tokens(self) -> int:
        """Context tokens drafters had to take in because they had missed them while others drafted."""
        return sum(r.catch_up for r in self.rounds)

    def per_position_acceptance(self) -> list[float]:
        """Share of rounds with a token drafted at position j whose token j was accepted."""
        depth = max((r.drafted for r in self.rounds), default=0)
        rates = []
        for j in range(depth):
            drafted = [r for r in self.rounds if r.drafted > j]
            rates.append(sum(r.accepted > j for r in drafted) / len(drafted))
        return rates

    def drafters(self) -> dict[str, DrafterStats]:
        """Each drafter's totals, by name; a free drafter's continuations of a model's drafts count as its tokens,
        not as its rounds."""
        out: dict[str, DrafterStats] = {}
        for r in self.rounds:
            if r.drafter is None:
                continue
            own = r.own
            s = out.setdefault(r.drafter, DrafterStats())
            s.pulls += 1
            s.drafted += own
            s.accepted += min(r.accepted, own)
            s.reward_sum += r.reward or 0.0
            if r.continued_by is not None:  # the continuation's tokens are its drafter's, without a pull
                c = out.setdefault(r.continued_by, DrafterStats())
                c.drafted += r.extended
                c.accepted += max(r.accepted - own, 0)
        return out

    def to_dict(self, rounds: bool = False) -> dict:
        """The statistics as JSON-ready values (times in seconds), with every round's record when `rounds`."""
        out = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": len(self.rounds),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "wall_time": round(self.wall_time, 4),
            "switches": self.switches,
            "catch_up_tokens": self.catch_up_tokens,
            "draft_time": round(sum(r.draft_time for r in self.rounds), 4),
            "verify_time": round(sum(r.verify_time for r in self.rounds), 4),
            "policy_time": round(sum(r.policy_time for r in self.rounds), 6),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "tree_rounds": sum(r.branch_nodes > 0 for r in self.rounds),  # rounds that verified other branches
            "branch_nodes": sum(r.branch_nodes for r in self.rounds),
            "branch_accepted": sum(r.branch_accepted for r in self.rounds),
            "drafters": {
                name: {
                    "pulls": s.pulls,
                    "drafted": s.drafted,
                    "accepted": s.accepted,
                    "mean_reward": round(s.mean_reward, 4),
                }
                for name, s in self.drafters().items()
            },
        }
        if rounds:
            out["round_log"] = [asdict(r) for r in self.rounds]
        return out


@dataclass(frozen=True)
class GenerationResult:
    """A finished request: its text, the ids it generated, its statistics and why it stopped."""

    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    finish_reason: str  # "stop" (end-of-sequence token) or "length" (max_new_tokens)
