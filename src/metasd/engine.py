"""The decoder: a target, a pool of drafters and a policy that picks one drafter per round (MetaSD, arXiv 2604.05417).

One round: select a drafter -> it proposes up to k tokens (a policy that grows trees adds other drafters' proposals
as branches: `metasd.tree`) -> one target forward over them -> the acceptance rule keeps a path and adds the
target's own token -> the policy is rewarded. That is `Generation.step`, in phases (`outlook`, `choose`, `draft`, the
forward, `conclude`) that a batch (`metasd.batching`) runs for several requests around one forward; everything else
(prompt handling, request options, statistics) is bookkeeping around it.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from .cached_model import CachedModel, common_prefix, feature_layers_read_by
from .costs import CostModel, TargetCost, load_or_calibrate
from .drafters import DEFAULT_POOL, Draft, Drafter, build_drafter, default_pool, model_drafter, parse_drafters
from .drafters.base import StoppableDrafter
from .models.linear_kernels import KERNEL_MODES
from .models.loading import LoadedModel, adopt_model, dtype_name, load_model, token_ids
from .outcome import Extension, RoundOutcome
from .policy import DEFAULT_POLICY, Policy, build_policy, canonical_policy
from .policy.adaptive import DEFAULTS as ADAPTIVE_DEFAULTS
from .policy.adaptive import AdaptivePolicy
from .processors import process, target_processors
from .sampling import SamplingParams, probabilities
from .stats import GenerationStats, Round
from .tree import DraftTree
from .verify import Verdict, verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling

_POLICY_CACHE = 64  # policies kept per decoder (LRU): clients can name many distinct policies and pools

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    finish_reason: str  # "stop" (end-of-sequence token) or "length" (max_new_tokens)


@dataclass
class _Clock:
    """A round's timestamps (time.perf_counter), named by what had just happened."""

    started: float = field(default_factory=lambda: time.perf_counter())
    chosen: float = 0.0  # the policy chose (drafter, k)
    drafted: float = 0.0  # the chosen drafter drafted
    verifying: float = 0.0  # any continuation appended; the target's forward starts
    forwarded: float = 0.0  # the target's forward returned
    accepting: float = 0.0  # this request's acceptance rule starts (in a batch, after other requests' conclusions)
    verified: float = 0.0  # the acceptance rule decided
    finished: float = 0.0  # the policy learned, caches synced

    @property
    def draft_seconds(self) -> float:
        return self.drafted - self.chosen

    @property
    def forward_seconds(self) -> float:
        return self.forwarded - self.verifying

    @property
    def accept_seconds(self) -> float:
        return self.verified - self.accepting

    @property
    def verify_seconds(self) -> float:
        """The forward and this request's own acceptance rule: in a batch, not the requests concluded before it."""
        return self.forward_seconds + self.accept_seconds

    @property
    def total_seconds(self) -> float:
        return self.finished - self.started


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
            drafter = self._drafter(item, dtype)
            if drafter.name in self.drafters:
                raise ValueError(f"drafter pool lists {drafter.name!r} twice")
            self.drafters[drafter.name] = drafter
        self.draft_len = draft_len
        self.policy_scope = policy_scope
        self.kernels = kernels
        self.seed = seed
        self.default_policy = policy
        readers = [d for d in self.drafters.values() if getattr(d, "reads_target_features", False)]
        self._lm = CachedModel(  # EAGLE heads read its features
            self.target.model, keep_features=bool(readers), feature_layers=feature_layers_read_by(readers)
        )
        for drafter in readers:
            drafter.read_features_from(self._lm)
        self._policies: OrderedDict[tuple[str, tuple[str, ...]], Policy | None] = OrderedDict()
        self._costs: CostModel | None = None
        # calibrate now whatever the policy: it also picks the target's linear kernels, and every request (plain
        # decoding and Hugging Face's generate included) must run on the kernels it will run on later
        self.cost_model(ADAPTIVE_DEFAULTS["max"] + 1)
        # fail now, not at the first request; the one place a policy may extend the calibrated range (T(M) up to
        # its max + 1): requests never calibrate (see _policy)
        self._policy(policy, list(self.drafters), calibrate=True)

    def _drafter(self, item: str | Drafter | tuple, dtype: str) -> Drafter:
        """A pool entry: a spec, a drafter object, or a (model, tokenizer) pair (an `lm:` drafter as it is)."""
        if isinstance(item, str):
            return build_drafter(item, self.target, dtype)
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], torch.nn.Module):
            return model_drafter(item[0], item[1], self.target)
        if isinstance(item, torch.nn.Module):
            raise ValueError("a model object in the drafter pool goes with its tokenizer: (model, tokenizer)")
        if isinstance(item, Drafter):
            return item
        raise ValueError(f"a drafter is a spec, a Drafter object or a (model, tokenizer) pair, got {item!r}")

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
        generation_config: GenerationConfig | None = None,
    ) -> Generation:
        """An iterable generation: each step yields the tokens one round added. Validates everything first.
        generation_config: a transformers `GenerationConfig` standing in for the model's own: its end-of-sequence
        ids and logits processors (repetition penalty, ...) apply; sampling comes from the arguments above."""
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
        chosen = self._policy(policy or self.default_policy, names, regime)
        return Generation(self, ids, max_new_tokens, params, chosen, pool, generation_config)

    def generate(self, prompt: Prompt, **options) -> GenerationResult:
        """Decode to the end. Options are those of `stream`."""
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result()

    def cost_model(self, max_tokens: int | None = None) -> CostModel:
        """The machine's costs (T(M) calibrated on first use, from the disk cache when it has this model and
        machine; refined by every round after). max_tokens: the largest M it must cover."""
        need = max(max_tokens or 0, self.draft_len + 1)
        if self._costs is None or self._costs.target.max_tokens < need:
            candidates = KERNEL_MODES[self.kernels]
            table = load_or_calibrate(self.target.spec, self.target.model, need, candidates=candidates).table
            if self._costs is None:
                self._costs = CostModel(TargetCost(table))
            else:
                self._costs.target = TargetCost(table)
        return self._costs

    def snapshot_policies(self) -> dict:
        """What the kept policies have learned, to `restore_policies` later (the benchmark measures a question
        several times from one state). The machine's cost model is not part of it: it stays shared and live."""
        return {
            key: copy.deepcopy({k: v for k, v in vars(p).items() if k != "costs"})
            for key, p in self._policies.items()
            if p is not None
        }

    def restore_policies(self, snapshot: dict) -> None:
        """Back to a `snapshot_policies` state: policies made since are dropped (the next request makes them anew)."""
        for key in [key for key in self._policies if key not in snapshot]:
            del self._policies[key]
        for key, state in snapshot.items():
            if key in self._policies:
                vars(self._policies[key]).update(copy.deepcopy(state))

    def _policy(self, name: str, names: list[str], regime: str = "greedy", calibrate: bool = False) -> Policy | None:
        """Request scope: a fresh bandit each request (metasd-adaptive is kept: its reset() starts a request from
        what earlier ones learned). Server scope: one policy per (policy, pool, regime) that keeps learning. Greedy
        and sampled requests never share one: acceptance rates and confidence levels mean different things in each,
        and their rounds cost differently.

        calibrate: may extend the calibrated T(M) to a metasd-adaptive policy's longest draft (construction only).
        Otherwise a policy drafting longer than the range calibrated at construction is a ValueError: a request
        must never calibrate (seconds in the serving thread, kernels re-routed under everyone, the online T(M)
        estimates dropped); `cost_model(max + 1)` extends the range explicitly, between requests."""
        key = (canonical_policy(name, names), tuple(names), regime)
        if key in self._policies:
            self._policies.move_to_end(key)
            return self._policies[key]
        policy = build_policy(name, names, self.seed)
        if isinstance(policy, AdaptivePolicy):
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
                [not d.has_cache for d in pool],
                [d.has_cache and isinstance(d, StoppableDrafter) for d in pool],
                regime,
            )
        if self.policy_scope == "server" or isinstance(policy, AdaptivePolicy):
            self._policies[key] = policy
            while len(self._policies) > _POLICY_CACHE:
                self._policies.popitem(last=False)
        return policy


@dataclass
class Turn:
    """One round of a request between its phases (`Generation.outlook`, `choose`, `draft`, `conclude`): what the
    policy saw, what it chose, and the tree the target verifies. A batch runs each phase for every request in
    flight and one target forward for all of them."""

    clock: _Clock
    limit: int  # the longest draft this round may verify (max_draft, and the tokens still wanted)
    remaining: int  # tokens the request may still generate
    lags: list[int]  # tokens each model drafter must take in before drafting
    fresh: list[bool]  # model drafters that have not drafted in this request yet
    proposals: dict[int, Draft]  # every free drafter's proposal (for policies that want them)
    proposal_times: dict[int, float]
    arm: int | None = None
    k: int = 0
    draft: Draft = field(default_factory=lambda: Draft([]))
    extension: Extension | None = None
    tree: DraftTree = field(default_factory=DraftTree)


class Generation:
    """One request in flight; iterate it to decode, stop iterating to abandon it.

    Its target is the decoder's cache, or a row of a batch (`metasd.batching`), which drives the same phases."""

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
        self.target = decoder._lm  # what verifies: logits_for_tree, fed_tokens, reset (a batch gives a row)
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
        return GenerationResult(
            self.decoder.decode(self.token_ids), list(self.token_ids), self.stats, self.finish_reason
        )

    @property
    def started(self) -> bool:
        return self._started is not None

    @property
    def done(self) -> bool:
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
        if self.policy is not None and self.decoder.policy_scope == "request":
            self.policy.reset()
        self._synced = {d.name: 0 for d in self.pool}
        self._started = time.perf_counter()

    def finish(self) -> None:
        """The request ended (or was abandoned): what was generated is real output, for the policy and drafters."""
        if self._finished or not self.started:
            return
        self._finished = True
        if self.policy is not None:
            self.policy.finish(self.context)
        for drafter in self.pool:
            drafter.end(self.context)

    def _rounds(self) -> Iterator[list[int]]:
        self.begin()
        try:
            while not self.done:
                yield self.step()
        finally:  # also when the consumer stops early
            self.finish()

    def step(self) -> list[int]:
        """One round on its own: choose, draft, verify, learn. Returns the tokens it added to the context."""
        turn = self.outlook()
        self.choose(turn)
        self.draft(turn)
        turn.clock.verifying = time.perf_counter()
        fed = self.target.fed_tokens
        logits = self.target.logits_for_tree(self.context, turn.tree)
        turn.clock.forwarded = time.perf_counter()
        prefilled = self.target.fed_tokens - fed > turn.tree.size + 1
        return self.conclude(turn, logits, prefilled=prefilled, alone=True)

    @property
    def room(self) -> int:
        """The longest draft the next round may verify (max_draft, and the tokens still wanted)."""
        return min(self.max_draft, self.max_new_tokens - len(self.token_ids) - 1)

    def outlook(self, propose: bool = True) -> Turn:
        """What a round starts from: the draft room, the drafters' lags, and the free drafters' proposals (for a
        policy that wants them, unless the round will not draft: propose False)."""
        clock = _Clock()
        remaining = self.max_new_tokens - len(self.token_ids)
        # tokens each model drafter must take in before drafting: the prompt on its first draft, then what it missed
        lags = [len(self.context) - self._synced[d.name] if d.has_cache else 0 for d in self.pool]
        fresh = [d.has_cache and d.name not in self._drafted for d in self.pool]
        wants = propose and self.policy is not None and self.policy.wants_proposals
        proposals, times = self._proposals(self.context, self.room) if wants else ({}, {})
        return Turn(clock, self.room, remaining, lags, fresh, proposals, times)

    def choose(self, turn: Turn) -> None:
        """The policy's (drafter, k) for a request decoding alone."""
        if self.policy is not None and turn.limit > 0:
            turn.arm, turn.k = self.policy.choose(
                turn.limit, turn.proposals, turn.lags, remaining=turn.remaining, fresh=turn.fresh
            )

    def draft(self, turn: Turn, stop_rules: bool = True) -> None:
        """The chosen drafter drafts (its stop rule may end it early: stop_rules), a free drafter may continue it,
        and a policy that grows trees adds branches."""
        turn.clock.chosen = time.perf_counter()
        draft = self._draft(turn.arm, turn.k, self.context, turn.proposals, self._generator, stop_rules)
        turn.clock.drafted = time.perf_counter()
        turn.draft, turn.extension = self._continue(turn.arm, draft, self.context, turn.limit)
        turn.tree = self._grow(turn.arm, turn.draft, turn.proposals)

    def conclude(self, turn: Turn, logits: torch.Tensor, prefilled: bool, alone: bool) -> list[int]:
        """The acceptance rule on the target's logits for the turn's tree, then the policy learns and the statistics
        record the round. prefilled: the forward also took in the prompt; alone: it verified this request only
        (then it measures T(M); a batch's forward measures the batch's costs). Returns the tokens added."""
        policy, clock, tree, draft, arm = self.policy, turn.clock, turn.tree, turn.draft, turn.arm
        clock.accepting = time.perf_counter()
        verdict, p = self._accept(logits, tree)
        clock.verified = time.perf_counter()
        path = tree.path_tokens(verdict.path)
        new = self._emit(path + [verdict.next_token])
        accepted = common_prefix(draft.tokens, path)  # of the chosen drafter's draft
        start = len(self.context)
        self.context += new
        self.token_ids += new
        outcome = RoundOutcome(
            arm=arm,
            k=turn.k,
            draft=draft,
            accepted=accepted,
            start=start,
            context=self.context,
            p=p,
            target_tokens=verdict.target_tokens,
            proposals=turn.proposals,
            extension=turn.extension,
            tree_accepted=None if len(tree.branches) == 1 else len(path),
            **self._reward_times(
                arm, draft, tree.size, turn.proposal_times.get(arm, 0.0), clock, prefilled, turn.fresh
            ),
        )
        score = policy.feedback(outcome) if policy is not None else None
        drafter = self.pool[arm] if arm is not None else None
        if drafter is not None and drafter.has_cache:  # its cache holds the context it drafted from and forwards - 1
            # of its tokens; those the round accepted it need not take in again
            self._synced[drafter.name] = start + min(max(draft.forwards - 1, 0), accepted)
            self._drafted.add(drafter.name)
        clock.finished = time.perf_counter()
        taken_in = turn.lags[arm] if arm is not None else 0
        self._measure(drafter, draft, tree.size, taken_in, clock, prefilled or not alone, arm in turn.proposals)
        draft_time = turn.proposal_times.get(arm, 0.0) + clock.draft_seconds
        self.stats.rounds.append(
            Round(
                drafter=drafter.name if drafter else None,
                drafted=len(draft.tokens),
                accepted=min(accepted, len(new)),
                reward=score,
                catch_up=taken_in - len(self.prompt) if arm is not None and turn.fresh[arm] else taken_in,  # no prompt
                draft_time=draft_time,
                verify_time=clock.verify_seconds,
                policy_time=clock.total_seconds - draft_time - clock.verify_seconds,
                emitted=len(new),
                chosen_k=turn.k,
                extended=len(draft.tokens) - outcome.own,
                continued_by=self.pool[extension.arm].name
                if (extension := turn.extension) and extension.arm is not None
                else None,
                branch_nodes=tree.size - len(draft.tokens),
                branch_accepted=max(min(len(path), len(new)) - min(accepted, len(new)), 0),
            )
        )
        self.stats.new_tokens = len(self.token_ids)
        self.stats.wall_time = time.perf_counter() - self._started
        return new

    def _grow(self, arm: int | None, draft: Draft, proposals: dict[int, Draft]) -> DraftTree:
        """The round's draft tree: the chosen draft, and for a policy that grows trees the branches it adds (free
        proposals, a model draft's runners-up: deterministic tokens, tried after the drawn ones, so sampling stays
        exact), within the sizes T(M) is calibrated for."""
        tree = DraftTree.chain(draft, arm)
        if arm is not None and self.policy.grows_trees:  # a plain step stays one
            room = self.decoder.cost_model().target.max_tokens - 1
            for branch_arm, branch in self.policy.branches(tree, proposals, room):
                tree.add(branch_arm, branch)
        return tree

    def _accept(self, logits: torch.Tensor, tree: DraftTree) -> tuple[Verdict, torch.Tensor | None]:
        """The target's own logits processors, then the acceptance rule over the tree: the verdict and p (sampling
        only: the rows of the chosen draft)."""
        if self.processors is not None:  # each row as generate processes it after the context and its path
            logits = process(self.processors, logits, self.context, tree.prefixes())
        p = None if self.params.greedy else probabilities(logits, self.params)
        main = tree.branches[0]
        if len(tree.branches) > 1:
            verdict = verify_tree_greedy(logits, tree) if p is None else verify_tree_sampling(p, tree, self._generator)
            p = None if p is None else p[[0, *(n + 1 for n in main.nodes)]]
        elif p is None:
            verdict = verify_greedy(logits, main.draft.tokens)
        else:
            verdict = verify_sampling(p, main.draft.q, main.draft.tokens, self._generator)
        return verdict, p

    def _reward_times(
        self,
        arm: int | None,
        draft: Draft,
        verified: int,
        proposal_time: float,
        clock: _Clock,
        prefilled: bool,
        fresh: list[bool],
    ) -> dict[str, float]:
        """The times the policy's reward sees: what the round costs in steady state. A prompt prefill (the target's,
        or a fresh model drafter's first draft taking in its own copy) is replaced by the cost model's estimate of
        the same round without it, as T(M) and the step costs leave prefills out."""
        costs = self.decoder._costs
        draft_time, verify_time = proposal_time + clock.draft_seconds, clock.verify_seconds
        if costs is None:
            return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": 0.0}
        if prefilled:
            verify_time = costs.target(verified + 1) + clock.accept_seconds
        if arm is not None and fresh[arm]:
            draft_time = draft.forwards * costs.drafter(self.pool[arm].name).step_time(costs.target(1))
        return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": costs.target(1)}

    def _measure(
        self,
        drafter: Drafter | None,
        draft: Draft,
        verified: int,
        taken_in: int,
        clock: _Clock,
        unmeasured: bool,
        free: bool,
    ) -> None:
        """The machine's costs, whatever the policy: every round is a measurement (but prefills and batch rounds,
        which measure other shapes). T(M) is the forward alone; the acceptance rule, processing and bookkeeping go
        to the regime's per-round overhead."""
        costs = self.decoder._costs
        if costs is None:
            return
        if drafter is not None and not free:
            costs.drafter(drafter.name).observe(draft.forwards, taken_in, clock.draft_seconds)
        if not unmeasured:
            costs.target.observe(verified + 1, clock.forward_seconds)
            regime = "greedy" if self.params.greedy else "sampled"
            costs.overhead[regime].add(max(clock.total_seconds - clock.draft_seconds - clock.forward_seconds, 0.0))

    def _proposals(self, context: list[int], k: int) -> tuple[dict[int, Draft], dict[int, float]]:
        """Every free drafter's k-token proposal (microseconds each), for policies that choose or learn from them."""
        drafts, times = {}, {}
        if k <= 0:
            return drafts, times
        for arm, drafter in enumerate(self.pool):
            if not drafter.has_cache:
                start = time.perf_counter()
                drafts[arm] = _deterministic(drafter, drafter.propose(context, k, self.params, None))
                times[arm] = time.perf_counter() - start
        return drafts, times

    def _draft(
        self,
        arm: int | None,
        k: int,
        context: list[int],
        proposals: dict[int, Draft],
        generator: torch.Generator,
        stop_rules: bool,
    ) -> Draft:
        if arm is None or k == 0:
            return Draft([])
        if arm in proposals:  # deterministic tokens: cutting them to the chosen length biases nothing
            return proposals[arm].truncated(k)
        drafter = self.pool[arm]
        stop = self.policy.stop_rule(arm, k) if stop_rules else None
        if stop is not None and isinstance(drafter, StoppableDrafter):
            draft = drafter.propose_until(context, k, self.params, generator, stop)
        else:
            draft = drafter.propose(context, k, self.params, generator)
        return draft if drafter.has_cache else _deterministic(drafter, draft)

    def _continue(
        self, arm: int | None, draft: Draft, context: list[int], limit: int
    ) -> tuple[Draft, Extension | None]:
        """A model drafter's draft, continued by a free drafter where the policy finds it pays (`limit` tokens in
        all at most): the free drafters propose for the context the model's tokens lead to (microseconds), and a
        copy that picks up there costs only its verification, nearly nothing where T(M) is flat. The proposals
        go to the policy even when none is appended: it learns what continuations are worth from all of them."""
        if (
            arm is None
            or not self.pool[arm].has_cache
            or not self.policy.extends
            or not draft.tokens
            or len(draft.tokens) >= limit
            or self.eos_token_ids.intersection(draft.tokens)
        ):
            return draft, None
        after, _ = self._proposals(context + draft.tokens, limit - len(draft.tokens))
        choice = self.policy.extension(arm, draft, after)
        if choice is None:
            return draft, Extension(len(draft.tokens), None, after)
        free, n = choice
        return draft.followed_by(after[free].truncated(n)), Extension(len(draft.tokens), free, after)

    def _emit(self, verified: list[int]) -> list[int]:
        """What the output takes of a round's tokens: up to max_new_tokens, and up to an end-of-sequence token."""
        new = verified[: self.max_new_tokens - len(self.token_ids)]
        stop = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
        if stop is not None:
            self.finish_reason = "stop"
            return new[: stop + 1]
        return new


def _deterministic(drafter: Drafter, draft: Draft) -> Draft:
    """A free drafter's draft, checked one-hot: the engine cuts free proposals to the chosen length and continues
    model drafts with them after seeing their tokens, which biases sampling unless the tokens are deterministic."""
    if draft.q is not None:
        raise ValueError(
            f"drafter {drafter.name!r} has no cache (a free drafter) but returned q: a free drafter's proposals must "
            "be deterministic (Draft.q None), as they are cut and appended after their tokens are seen; give it "
            "has_cache = True to have its sampled drafts verified whole"
        )
    return draft
