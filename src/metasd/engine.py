"""The decoder: a target, a pool of drafters and a policy that picks one drafter per round.

One round: select a drafter -> it proposes up to k tokens -> one target forward over them -> the acceptance rule
keeps a prefix and adds the target's own token -> the policy is rewarded. That is `Generation._round`; everything
else (prompt handling, request options, statistics) is bookkeeping around it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .cached_model import CachedModel, common_prefix
from .drafters import Draft, Drafter, build_drafter, parse_drafters
from .models import LoadedModel, load_model
from .policies import Policy, build_policy
from .rewards import reward
from .sampling import SamplingParams, probabilities
from .stats import GenerationStats, Round
from .verify import verify_greedy, verify_sampling

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    finish_reason: str  # "stop" (end-of-sequence token) or "length" (max_new_tokens)


class Decoder:
    """Built once (models load here); `generate` and `stream` serve one request at a time."""

    def __init__(
        self,
        target: str | None = None,
        drafters: str | Sequence[str | Drafter] = ("ngram", "suffix", "early-exit"),
        policy: str = "metasd-ucb",
        draft_len: int = 5,
        dtype: str = "float32",
        policy_scope: str = "request",
        seed: int | None = None,
    ):
        if not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"draft_len must be an integer >= 1, got {draft_len!r}")
        if policy_scope not in ("request", "server"):
            raise ValueError(f"policy_scope must be 'request' or 'server', got {policy_scope!r}")
        self.target: LoadedModel = load_model(target, dtype)
        self.tokenizer = self.target.tokenizer
        self.drafters: dict[str, Drafter] = {}
        for item in parse_drafters(drafters) if isinstance(drafters, str) else drafters:
            drafter = item if isinstance(item, Drafter) else build_drafter(item, self.target, dtype)  # spec or object
            if drafter.name in self.drafters:
                raise ValueError(f"drafter pool lists {drafter.name!r} twice")
            self.drafters[drafter.name] = drafter
        self.draft_len = draft_len
        self.policy_scope = policy_scope
        self.seed = seed
        self.default_policy = policy
        self._lm = CachedModel(self.target.model)
        self._policies: dict[tuple[str, tuple[str, ...]], Policy | None] = {}
        self._policy(policy, list(self.drafters))  # fail now, not at the first request

    @property
    def drafter_names(self) -> list[str]:
        return list(self.drafters)

    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Text gets the chat template (as one user turn) unless raw; messages always do; ids pass through."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            if raw:
                return list(self.tokenizer(prompt)["input_ids"])
            prompt = [{"role": "user", "content": prompt}]
        if not prompt:
            raise ValueError("prompt is empty")
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt):
            raise ValueError("chat messages must be objects with 'role' and string 'content'")
        text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        raw: bool = False,
        policy: str | None = None,
        drafters: Sequence[str] | None = None,
    ) -> Generation:
        """An iterable generation: each step yields the tokens one round added. Validates everything first."""
        params = SamplingParams(temperature, top_k, top_p, seed if seed is not None else self.seed)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        ids = self.encode(prompt, raw)
        if len(ids) + max_new_tokens > self.target.max_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {self.target.max_length} tokens"
            )
        names = self.drafter_names if drafters is None else parse_drafters(drafters)
        unknown = [n for n in names if n not in self.drafters]
        if unknown:
            raise ValueError(f"drafters {unknown} are not in the loaded pool {self.drafter_names}")
        pool = [self.drafters[n] for n in names]
        return Generation(self, ids, max_new_tokens, params, self._policy(policy or self.default_policy, names), pool)

    def generate(self, prompt: Prompt, **options) -> GenerationResult:
        """Decode to the end. Options are those of `stream`."""
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result()

    def _policy(self, name: str, names: list[str]) -> Policy | None:
        """Request scope: a fresh policy each request. Server scope: one per (policy, pool) that keeps learning."""
        key = (name, tuple(names))
        if self.policy_scope == "server" and key in self._policies:
            return self._policies[key]
        policy = build_policy(name, names, self.seed)
        if self.policy_scope == "server":
            self._policies[key] = policy
        return policy


class Generation:
    """One request in flight; iterate it to decode, stop iterating to abandon it."""

    def __init__(self, decoder: Decoder, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 policy: Policy | None, pool: list[Drafter]):
        self.decoder = decoder
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.policy = policy
        self.pool = pool
        self.token_ids: list[int] = []
        self.finish_reason = "length"
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self._iter = self._rounds()

    def __iter__(self) -> Iterator[list[int]]:
        return self._iter

    def close(self) -> None:
        """Abandon the request now rather than whenever it is garbage-collected: the drafters see its end."""
        self._iter.close()

    def result(self) -> GenerationResult:
        return GenerationResult(self.decoder.decode(self.token_ids), list(self.token_ids), self.stats,
                                self.finish_reason)

    def _rounds(self) -> Iterator[list[int]]:
        dec = self.decoder
        generator = torch.Generator()
        if self.params.seed is not None:
            generator.manual_seed(self.params.seed)
        else:
            generator.seed()
        context = list(self.prompt)
        dec._lm.reset()
        for drafter in self.pool:
            drafter.begin(self.prompt)
        if self.policy is not None and dec.policy_scope == "request":
            self.policy.reset()
        synced = {d.name: len(context) for d in self.pool}  # context length each drafter has seen
        start = time.perf_counter()
        try:
            while len(self.token_ids) < self.max_new_tokens and self.finish_reason != "stop":
                new = self._round(context, generator, synced)
                context += new
                self.token_ids += new
                self.stats.new_tokens = len(self.token_ids)
                self.stats.wall_time = time.perf_counter() - start
                yield new
        finally:  # also when the consumer stops early: what was generated is real output
            for drafter in self.pool:
                drafter.end(context)

    def _round(self, context: list[int], generator: torch.Generator, synced: dict[str, int]) -> list[int]:
        """Select, draft, verify, reward: the tokens this round adds (its statistics are recorded here)."""
        dec, params, policy = self.decoder, self.params, self.policy
        t0 = time.perf_counter()
        k = min(dec.draft_len, self.max_new_tokens - len(self.token_ids) - 1)
        arm = policy.select() if policy is not None and k > 0 else None
        t1 = time.perf_counter()
        drafter = self.pool[arm] if arm is not None else None
        draft = drafter.propose(context, k, params, generator) if drafter else Draft([])
        t2 = time.perf_counter()
        logits = dec._lm.logits_for(context + draft.tokens, last=len(draft.tokens) + 1)
        p = probabilities(logits, params) if drafter or not params.greedy else None
        if params.greedy:
            verdict = verify_greedy(logits, draft.tokens)
        else:
            verdict = verify_sampling(p, draft.q, draft.tokens, generator)
        t3 = time.perf_counter()
        verified = draft.tokens[: verdict.accepted] + [verdict.next_token]
        score = None
        if drafter:
            score = reward(policy.reward, p, draft.q, draft.tokens, verdict.accepted, k, t2 - t1, t3 - t2)
            policy.update(arm, score)
            if policy.full_information:
                self._hindsight(arm, context, verified, k, t3 - t2)
        t4 = time.perf_counter()
        new = verified[: self.max_new_tokens - len(self.token_ids)]
        stop = next((i for i, t in enumerate(new) if t in dec.target.eos_token_ids), None)
        if stop is not None:
            new = new[: stop + 1]
            self.finish_reason = "stop"
        catch_up = 0
        if drafter:
            catch_up = len(context) - synced[drafter.name] if drafter.has_cache else 0
            synced[drafter.name] = len(context) + len(new)
        self.stats.rounds.append(Round(drafter.name if drafter else None, len(draft.tokens), verdict.accepted,
                                       score, catch_up, t2 - t1, t3 - t2, (t1 - t0) + (t4 - t3)))
        return new

    def _hindsight(self, chosen: int, context: list[int], verified: list[int], k: int, verify_time: float) -> None:
        """Full-information feedback: score every free drafter on what it would have drafted this round.

        Free drafters (no cache) propose in microseconds, so the bandit need not spend rounds exploring them.
        """
        for arm, drafter in enumerate(self.pool):
            if arm == chosen or drafter.has_cache:
                continue
            start = time.perf_counter()
            tokens = drafter.propose(context, k, self.params, None).tokens
            matched = common_prefix(tokens, verified)
            score = reward(self.policy.reward, None, None, tokens, matched, k, time.perf_counter() - start, verify_time)
            self.policy.observe(arm, score)
