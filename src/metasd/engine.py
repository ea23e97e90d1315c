"""The decoder (MetaSD, arXiv 2604.05417): a target, a pool of drafters and a policy that picks one drafter per round.
Built once (models load here), it encodes prompts, checks each request's options and starts it as a
`generation.Generation`, whose phases a round (`round.run_round`) runs alone or in a batch (`metasd.batching`); it
keeps the policies that carry over between requests and the costs (T(M)) they price drafts with."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
from transformers import GenerationConfig

from .cached_model import CachedModel
from .costs import CostModel, calibrated
from .drafters import DEFAULT_POOL, Drafter, default_pool, parse_drafters, pool_entry
from .drafters.base import StoppableDrafter
from .generation import Generation
from .models.chat import chat_prompt_ids
from .models.features import feature_layers_read_by
from .models.linear_kernels import KERNEL_MODES
from .models.loading import LoadedModel, adopt_model, dtype_name, load_model
from .policy import DEFAULT_POLICY, Policy, build_policy, canonical_policy
from .policy.adaptive import DEFAULTS as ADAPTIVE_DEFAULTS
from .processors import target_processors
from .sampling import SamplingParams
from .stats import GenerationResult

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
        """Text gets the chat template (as one user turn) unless raw; messages always do (a tokenizer without a
        template, a base model's, reads their contents joined by newlines: `models.chat`); ids pass through."""
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
        return chat_prompt_ids(self.tokenizer, prompt)

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
