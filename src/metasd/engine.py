"""The decoder: a target, a pool of drafters and a policy that picks one drafter per round (MetaSD, arXiv 2604.05417).

One round: select a drafter -> it proposes up to k tokens (a policy that grows trees adds other drafters' proposals
as branches: `metasd.tree`) -> one target forward over them -> the acceptance rule keeps a path and adds the
target's own token -> the policy is rewarded. That is `Generation.step`, in phases (`start_round`, `choose`, `draft`:
`metasd.drafting`, the forward, `accept`) that a batch (`metasd.batching`) runs for several requests around one
forward (`metasd.round` holds a round between them); the rest (prompts, request options, statistics) is bookkeeping.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

import torch
from transformers import GenerationConfig

from .cached_model import CachedModel, TargetCache, common_prefix, feature_layers_read_by
from .costs import CostModel, calibrated, observe_round, reward_times
from .draft import Draft, DraftJob
from .drafters import DEFAULT_POOL, Drafter, default_pool, parse_drafters, pool_entry
from .drafters.base import StoppableDrafter
from .drafting import chosen_draft, continued_draft, draft_tree, free_proposals
from .models.linear_kernels import KERNEL_MODES
from .models.loading import LoadedModel, adopt_model, dtype_name, load_model, token_ids
from .outcome import RoundOutcome
from .policy import DEFAULT_POLICY, Policy, build_policy, canonical_policy
from .policy.adaptive import DEFAULTS as ADAPTIVE_DEFAULTS
from .processors import process, target_processors
from .round import OwnChoice, RoundClock, RoundState, run_round
from .sampling import SamplingParams
from .stats import GenerationResult, GenerationStats, Round
from .verify import verify_round

OWN_CHOICE = OwnChoice()
_POLICY_CACHE = 64  # policies kept per decoder (LRU): clients can name many distinct policies and pools

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


class Decoder:
    """Built once (models load here); `generate` and `stream` serve one request at a time."""

    def __init__(
        self,
        target: str | torch.nn.Module | None = None,
        drafters: str | Sequence[str | Drafter | tuple[torch.nn.Module, object]] = DEFAULT_POOL,
        policy: str = DEFAULT_POLICY,
        draft_len: int = 5,
        dtype: str | None = None,
        policy_scope: str = "request",
        seed: int | None = None,
        device: str = "auto",
        kernels: str | None = None,
        tokenizer: object | None = None,
    ):
        """target: a spec (the embedded model when None, a hub id, a directory, a `.gguf` file), loaded in `dtype`
        (default float32) on `device`; or a transformers causal LM object with its `tokenizer`, decoded as it is
        (its dtype, device and adapters; no second copy of the weights). drafters: specs, `Drafter` objects, or
        (model, tokenizer) pairs drafting as `lm:` drafters. kernels: the target's linear kernels (`auto` routes
        them per row count, the default for a spec; `torch` leaves them as they are, the default for an object)."""
        if not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"draft_len must be an integer >= 1, got {draft_len!r}")
        if policy_scope not in ("request", "server"):
            raise ValueError(f"policy_scope must be 'request' or 'server', got {policy_scope!r}")
        own = isinstance(target, torch.nn.Module)
        kernels = kernels or ("torch" if own else "auto")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
        if own:
            self.target: LoadedModel = adopt_model(target, tokenizer)
            dtype = dtype or dtype_name(target)
        elif tokenizer is not None:
            raise ValueError("tokenizer= goes with a model object as the target; a spec loads its own tokenizer")
        else:
            dtype = dtype or "float32"
            self.target = load_model(target, dtype, device)
        target_processors(self.target.model, 1, 1, self.target.spec)  # refuse what its generate does unlike us
        self.tokenizer = self.target.tokenizer
        self.drafters: dict[str, Drafter] = {}
        items = parse_drafters(drafters) if isinstance(drafters, str) else list(drafters)
        if tuple(items) == DEFAULT_POOL:
            items = default_pool(self.target)
        for item in items:
            drafter = pool_entry(item, self.target, dtype)
            if drafter.name in self.drafters:
                raise ValueError(f"drafter pool lists {drafter.name!r} twice")
            self.drafters[drafter.name] = drafter
        self.draft_len = draft_len
        self.policy_scope = policy_scope
        self.kernels = kernels
        self.seed = seed
        self.default_policy = policy
        readers = [d for d in self.drafters.values() if d.reads_target_features]
        self.target_cache = CachedModel(  # what verifies a request decoding alone; EAGLE heads read its features
            self.target.model, keep_features=bool(readers), feature_layers=feature_layers_read_by(readers)
        )
        for drafter in readers:
            drafter.read_features_from(self.target_cache)
        self._policies: OrderedDict[tuple[str, tuple[str, ...]], Policy | None] = OrderedDict()
        self._costs: CostModel | None = None
        # calibrate now whatever the policy: it also picks the target's linear kernels, and every request (plain
        # decoding and Hugging Face's generate included) must run on the kernels it will run on later
        self.cost_model(ADAPTIVE_DEFAULTS["max"] + 1)
        # fail now, not at the first request; the one place a policy may extend the calibrated range (T(M) up to
        # its max + 1): requests never calibrate (see _policy)
        self._policy(policy, list(self.drafters), calibrate=True)

    @property
    def drafter_names(self) -> list[str]:
        """The pool's drafter names, in the order policies number them."""
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
        """Token ids as text (special tokens left out)."""
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
        policy: str | Policy | None = None,
        drafters: Sequence[str] | None = None,
        generation_config: GenerationConfig | None = None,
    ) -> Generation:
        """An iterable generation: each step yields the tokens one round added. Validates everything first.
        generation_config: a transformers `GenerationConfig` standing in for the model's own: its end-of-sequence
        ids and logits processors (repetition penalty, ...) apply; sampling comes from the arguments above.
        policy: a name (the decoder keeps one per policy, pool and regime as its scope says), or a `Policy` object
        this request decodes with as it is."""
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
        regime = "greedy" if params.greedy else "sampled"
        if policy is None or isinstance(policy, str):
            chosen = self._policy(policy or self.default_policy, names, regime)
        else:  # an object: this request's own, as it is (attached by its maker if it uses costs)
            chosen = policy
        return Generation(self, ids, max_new_tokens, params, chosen, pool, generation_config)

    def generate(self, prompt: Prompt, **options) -> GenerationResult:
        """Decode to the end. Options are those of `stream`."""
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result()

    @property
    def costs(self) -> CostModel | None:
        """The machine's cost model once calibrated (`cost_model`), shared by every request; None before."""
        return self._costs

    @property
    def policies(self) -> Mapping[tuple[str, tuple[str, ...], str], Policy | None]:
        """The policies kept across requests, by (policy, pool, regime), least recently used first (read-only)."""
        return MappingProxyType(self._policies)

    def cost_model(self, max_tokens: int | None = None, max_batch: int = 1) -> CostModel:
        """The machine's costs (calibrated on first use, from the disk cache when it has this model and machine;
        refined by every round after). max_tokens: the largest M of T(M) it must cover; max_batch: the largest
        batch whose T(B, W) it must hold (`metasd.batching`), over the same widths (`costs.calibrated`)."""
        need = max(max_tokens or 0, self.draft_len + 1)
        spec, model, candidates = self.target.spec, self.target.model, KERNEL_MODES[self.kernels]
        self._costs = calibrated(self._costs, spec, model, need, max_batch, candidates)
        return self._costs

    def snapshot_policies(self) -> dict:
        """What the kept policies have learned, to `restore_policies` later (the benchmark measures a question
        several times from one state). The machine's cost model is not part of it: it stays shared and live."""
        return {key: p.snapshot() for key, p in self._policies.items() if p is not None}

    def restore_policies(self, snapshot: dict) -> None:
        """Back to a `snapshot_policies` state: policies made since are dropped (the next request makes them anew)."""
        for key in [key for key in self._policies if key not in snapshot]:
            del self._policies[key]
        for key, state in snapshot.items():
            if key in self._policies:
                self._policies[key].restore(state)

    def _policy(self, name: str, names: list[str], regime: str = "greedy", calibrate: bool = False) -> Policy | None:
        """Request scope: a fresh bandit each request (a policy that `carries_over` is kept). Server scope: one policy
        per (policy, pool, regime) that keeps learning; greedy and sampled requests never share one (rates mean
        other things in each, rounds cost differently). calibrate: may extend T(M) to a costed policy's longest
        draft (construction only); a request never calibrates (seconds in the serving thread, kernels re-routed
        under everyone), so a longer draft is refused: `cost_model(max + 1)` extends it between requests."""
        key = (canonical_policy(name, names), tuple(names), regime)
        if key in self._policies:
            self._policies.move_to_end(key)
            return self._policies[key]
        policy = build_policy(name, names, self.seed)
        if policy is not None and policy.uses_costs:
            calibrated = self.cost_model().target.max_tokens
            if not calibrate and policy.max_draft + 1 > calibrated:
                raise ValueError(
                    f"policy {name!r} drafts up to {policy.max_draft} tokens, but this decoder calibrated T(M) at "
                    f"start for drafts of up to {calibrated - 1}; requests never calibrate: start it with --policy "
                    f"metasd-adaptive:max={policy.max_draft} (library: that policy in Decoder(...), or "
                    f"Decoder.cost_model({policy.max_draft + 1}) between requests)"
                )
            costs = self.cost_model(policy.max_draft + 1)
            pool = [self.drafters[n] for n in names]
            policy.attach(
                costs,
                names,
                [not d.runs_model for d in pool],
                [d.runs_model and isinstance(d, StoppableDrafter) for d in pool],
                regime,
            )
        if self.policy_scope == "server" or (policy is not None and policy.carries_over):
            self._policies[key] = policy
            while len(self._policies) > _POLICY_CACHE:
                self._policies.popitem(last=False)
        return policy


class Generation:
    """One request in flight; iterate it to decode, stop iterating to abandon it. Its target is the decoder's cache,
    or a row of a batch (`metasd.batching`), which drives the same phases."""

    def __init__(
        self,
        decoder: Decoder,
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
