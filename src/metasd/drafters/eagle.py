"""A white-box drafter: an EAGLE head (arXiv 2401.15077) reading the target's own features (`eagle:PATH`).

The target's cache keeps its features of every verified position (`CachedModel.features_for`: the final norm's
output, after the layers a head fuses); the head turns (feature of position i, token i + 1) into a predicted
feature of position i + 1, read out by the target's LM head over the draft vocabulary. Its own KV cache holds one
entry per such pair and mirrors a token list like `CachedModel`: entries from the target's true features are kept
while their tokens match the context, entries from drafted (predicted) features are dropped before the next draft,
so it cannot drift. It draws from q and sends q (zero outside the draft vocabulary): sampling stays exact.

A draft step (one row through the head and the draft vocabulary's readout) is bound by memory bandwidth, so it
takes whichever of the float kernels (`models/linear_kernels.py`: torch's, weight-major, oneDNN) and int8 weights
(`models/int8_weights.py`, a quarter of float32's bytes) a one-row step measures faster here (`weights="auto"`);
the catch-up, whose entries stay in the cache, always runs on the float weights. q comes from the weights that
drew the draft: int8 changes which tokens are drafted, never the target's output or its distribution.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from transformers import DynamicCache

from ..cached_model import CachedModel
from ..draft import Draft, DraftJob
from ..models.eagle_head import EagleHead, fits, load_head
from ..models.features import feature_columns
from ..models.int8_weights import WEIGHTS, int8_twin, route_rows, split_weights
from ..models.linear_kernels import KERNELS, install
from ..models.timing import interleaved_medians, seconds
from ..sampling import SamplingParams, pick, probabilities
from ..tokens import common_prefix
from .base import AutoregressiveDrafter, DraftBuilder
from .suffix import SHARED as SHARED_KEY

SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # package data: a directory per shipped head


class HeadLearning(Protocol):
    """What learns a head from the traffic it drafts for (`metasd.learning.HeadLearner`): per history key, the
    head in service, and the verified sequences of that key's requests."""

    def current(self, key: str) -> tuple[int, EagleHead | None]:
        """(version, head in float32) in service for requests of history `key`; (0, None): the head as loaded."""
        ...

    def collect(self, key: str, tokens: torch.Tensor, features: torch.Tensor, prompt: int) -> None:
        """A finished request of history `key`: its tokens [n], the target's features [n, D] at each (the columns
        the head reads) and its prompt's length."""
        ...


def shipped_head(model: torch.nn.Module) -> Path | None:
    """The head shipped with metasd for this target model, if any (`eagle` with no path)."""
    heads = sorted(p.parent for p in SHIPPED.glob("*/config.json")) if SHIPPED.is_dir() else []
    return next((path for path in heads if fits(path, model)), None)


class EagleDrafter(AutoregressiveDrafter):
    """An EAGLE head drafting from the target's features; with `learn_from`, the head a learner keeps improving on
    the requests it serves (swapped in at a draft's start, so a round drafts with one head throughout)."""

    reads_target_features = True
    keeps_its_draft = False  # its next catch-up reruns every entry after the context it drafted from

    def __init__(self, head: EagleHead, target: torch.nn.Module, name: str, vocab_size: int, weights: str = "auto"):
        if weights not in WEIGHTS:
            raise ValueError(f"EAGLE head weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        self.name = name
        param = next(target.parameters())
        self.head = head.to(device=param.device, dtype=param.dtype).eval()
        self.embed = target.get_input_embeddings()
        readout = target.get_output_embeddings().weight[head.draft_vocab].detach()
        self.readout = torch.nn.Linear(readout.shape[1], readout.shape[0], bias=False, device=param.device)
        self.readout.weight = torch.nn.Parameter(readout, requires_grad=False)
        self.vocab_size = vocab_size
        self.feature_layers = head.config.feature_layers  # beside the final norm's output: the target keeps them
        layers = target.config.num_hidden_layers
        if any(not 0 <= layer < layers for layer in self.feature_layers):
            raise ValueError(
                f"{name} reads decoder layers {list(self.feature_layers)}, and the target has layers 0..{layers - 1}"
            )
        self.target_lm: CachedModel | None = None
        self._columns: torch.Tensor | None = None  # the target cache's feature columns this head reads
        # the catch-up (entries from the target's true features, kept across rounds) always runs on the float
        # weights, so what the cache holds never depends on how many rows a call had; draft steps (entries dropped
        # before the next draft) and the readout run on what `_route` chose
        self.exact_head = self.head
        self.float_readout = self.readout
        self.weights = self._route(weights)  # what a draft step runs on, as the bench reports for `lm:` drafters
        # learning from served traffic (`learn_from`): the learner, the history key of the requests now served
        # (None: the head as loaded, nothing collected), and per (key, version) the head prepared for drafting,
        # shared by this drafter's forks
        self.learning: HeadLearning | None = None
        self.history_key: str | None = SHARED_KEY
        self.version: tuple[str | None, int] = (None, 0)
        self._base = (self.head, self.exact_head, self.readout)
        self._served: dict[tuple[str | None, int], tuple[EagleHead, EagleHead, torch.nn.Module]] = {}
        self._prompt = 0
        self.reset_cache()

    @torch.inference_mode()
    def _route(self, weights: str, reps: int = 9) -> str:
        """Time a one-row step (head and readout) under each float kernel and on int8 weights, as `weights`
        allows, interleaved after a warm-up, and keep the fastest (`auto`); `int8` insists on int8 for draft
        steps (a ValueError where this torch build has no int8 kernel for the device), `unquantized` never tries
        it. Returns what was chosen."""
        floats = torch.nn.ModuleList([self.head, self.readout])
        device = self.readout.weight.device
        x = torch.zeros(1, 1, self.readout.in_features, dtype=self.readout.weight.dtype, device=device)

        def step_seconds(layers: torch.nn.ModuleList) -> float:
            cache = DynamicCache(config=self.head.body.config)
            return seconds(lambda: layers[1](layers[0](x, x, cache=cache)), device)

        candidates: dict[str, torch.nn.ModuleList] = {}
        if weights != "unquantized":
            twin = int8_twin(floats)
            route_rows(twin, 1)
            try:
                step_seconds(twin)
                candidates["int8 for one-row steps"] = twin
            except (NotImplementedError, RuntimeError) as err:
                if weights == "int8":
                    raise ValueError(f"{self.name}: int8 weights are not available on {device}: {err}") from err
                warnings.warn(f"{self.name}: int8 weights failed on {device} ({err}); drafting on float", stacklevel=2)
        if weights != "int8":
            candidates.update({f"unquantized, {kernel}": floats for kernel in KERNELS})

        def run(name: str) -> float:
            if candidates[name] is floats:
                install(floats, [name.partition(", ")[2]], keep=True)  # oneDNN's copies made once, not timed
            return step_seconds(candidates[name])

        medians = interleaved_medians(run, candidates, reps)
        best = min(medians, key=medians.__getitem__)
        # the float layers (catch-ups; the draft steps too if they won) keep no oneDNN copies they do not use
        install(floats, [best.partition(", ")[2] if candidates[best] is floats else KERNELS[0]])
        self.head, self.readout = candidates[best]
        return best

    def _prepared(self, head: EagleHead) -> tuple[EagleHead, EagleHead, torch.nn.Module]:
        """A newly learned head as this drafter runs it: (draft-step head, float head for catch-ups, readout) in
        the target's dtype, on the kernel or the int8 weights `_route` chose for the head as loaded."""
        param = self.float_readout.weight
        exact = copy.deepcopy(head).to(device=param.device, dtype=param.dtype).eval()
        if self.weights.startswith("int8"):
            twin = int8_twin(torch.nn.ModuleList([exact, self.float_readout]))
            route_rows(twin, 1)
            return twin[0], exact, twin[1]
        install(exact, [self.weights.partition(", ")[2]])
        return exact, exact, self.float_readout

    @property
    def loaded_head(self) -> EagleHead:
        """The head as loaded (float weights), whatever a learner has swapped in since: what learning grows from."""
        return self._base[1]

    def read_features_from(self, target_lm: CachedModel) -> None:
        """The decoder's target cache, whose features of verified positions the head reads: its blocks of d
        columns are the cache's `feature_layers`' outputs, then the final norm's; the head picks its own."""
        kept = target_lm.feature_layers
        if not target_lm.keep_features or not set(self.feature_layers) <= set(kept):
            raise ValueError(
                f"{self.name} needs a target cache that keeps its features (keep_features=True) and the outputs of "
                f"decoder layers {list(self.feature_layers)} (feature_layers)"
            )
        columns = feature_columns(kept, self.feature_layers, self.exact_head.config.hidden_size)
        self._columns = None if columns is None else columns.to(self.embed.weight.device)
        self.target_lm = target_lm

    def reset_cache(self) -> None:
        """An empty head cache: the next draft catches up on the whole context from the target's features."""
        self.cache = DynamicCache(config=self.head.body.config)
        self.pairs: list[int] = []  # token i + 1 of each cached entry i
        self.exact = 0  # entries [0, exact) were built from the target's true features

    def begin(self, prompt: list[int]) -> None:
        self._prompt = len(prompt)
        self.reset_cache()

    def learn_from(self, learning: HeadLearning) -> None:
        """Draft with the head `learning` keeps for each request's history key, and hand it each request's verified
        tokens and features at its end (online speculative decoding, Liu et al., arXiv 2310.07177)."""
        self.learning = learning

    def use_history(self, key: str | None) -> None:
        """Requests from now on learn, and draft from what was learned, in history `key` (None: neither; the
        head as loaded drafts and nothing is kept)."""
        self.history_key = key

    def revision(self) -> Hashable:
        """The head the next request drafts from: (history key, version) of a head learned from that key's traffic,
        or 0 for the head as loaded (no learner, no key, or nothing swapped in yet)."""
        if self.learning is None or self.history_key is None:
            return 0
        version, _ = self.learning.current(self.history_key)
        return (self.history_key, version) if version else 0

    def end(self, context: list[int]) -> None:
        """With a learner: the request's tokens and the target's features of them, verified positions only."""
        if self.learning is None or self.history_key is None or self.target_lm is None:
            return
        features = self.target_lm.features_for(context)
        if features.shape[0] < 2:
            return
        if self._columns is not None:
            features = features[:, self._columns]
        tokens = torch.tensor(context[: features.shape[0]])
        self.learning.collect(self.history_key, tokens, features.detach().to("cpu", torch.bfloat16), self._prompt)

    def _follow_learning(self) -> None:
        """Adopt the head in service for this request's history key if it changed since the last draft; the head's
        own cache restarts (its entries came from the other head) and catches up from the target's features."""
        if self.learning is None:
            return
        key = self.history_key
        version, head = (0, None) if key is None else self.learning.current(key)
        if (key, version) == self.version:
            return
        served = self._served.get((key, version))
        if served is None:
            served = self._base if head is None else self._prepared(head)
            for old in [k for k in self._served if k[0] == key]:
                del self._served[old]
            self._served[(key, version)] = served
        self.head, self.exact_head, self.readout = served
        self.version = (key, version)
        self.reset_cache()

    def next_q(self, context: list[int], params: SamplingParams) -> Callable[[list[int]], torch.Tensor] | None:
        """None before the target has verified the context (a request's first round: no features of the prompt yet).
        The first call catches the head up on the context; each later one feeds the token just drafted with the
        head's own predicted feature of its position."""
        features = self._features(context)
        if features is None:
            return None
        state = {"hidden": None}

        def q(seq: list[int]) -> torch.Tensor:
            if state["hidden"] is None:
                state["hidden"] = self._catch_up(context, features)
            else:
                state["hidden"] = self._step(state["hidden"], seq[-1])
            return probabilities(self._logits(state["hidden"]), params)[0]

        return q

    def _features(self, context: list[int]) -> torch.Tensor | None:
        """The target's features of the context, once this fork follows the learner (`_follow_learning`); None
        before the target has verified the context."""
        if self.target_lm is None:
            raise RuntimeError(f"{self.name}: no target cache attached (Decoder does it; see read_features_from)")
        self._follow_learning()
        features = self.target_lm.features_for(context)
        return None if len(context) < 2 or features.shape[0] < len(context) - 1 else features

    def batch_key(self) -> int:
        """Forks of one drafter draft together in a batch (those drafting with different learned heads, per
        history key, are told apart in `draft_batch`)."""
        return id(self._base[0])

    @classmethod
    def draft_batch(cls, jobs: Sequence[DraftJob]) -> list[tuple[Draft, float]]:
        """Forks drafting with the same head (the same learned version, if they learn) draft together
        (`_draft_rows`), each draft with the seconds it is charged; a fork that cannot draft yet drafts nothing."""
        out: list[tuple[Draft, float] | None] = [None] * len(jobs)
        by_head: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for i, job in enumerate(jobs):
            started = time.perf_counter()
            features = job.drafter._features(job.context)
            if features is None:
                out[i] = (Draft([], None, [], 0), time.perf_counter() - started)
            else:
                by_head.setdefault(id(job.drafter.head), []).append((i, features))
        for rows in by_head.values():
            drafted = cls._draft_rows([jobs[i] for i, _ in rows], [features for _, features in rows])
            for (i, _), one in zip(rows, drafted, strict=True):
                out[i] = one
        return out

    @staticmethod
    @torch.inference_mode()
    def _draft_rows(jobs: Sequence[DraftJob], features: Sequence[torch.Tensor]) -> list[tuple[Draft, float]]:
        """Forks of one head drafting for several requests: each catches up on its own context (its own cache and
        length, charged to it), then every draft step runs once for the rows still drafting (charged to them; a row
        whose draft is done leaves the steps). The rows' head caches are laid side by side, each padded to the
        longest and the padding masked, and every row sits at its own positions, so a row computes what it computes
        alone; the steps' entries are not kept (the next catch-up drops them as it does alone). A head on int8
        weights routed for one-row steps (`_route`) runs steps of several rows on its float weights."""
        forks = [job.drafter for job in jobs]
        built = [DraftBuilder() for _ in jobs]
        seconds = [0.0] * len(jobs)
        hidden = []
        for i, (fork, job) in enumerate(zip(forks, jobs, strict=True)):
            started = time.perf_counter()
            hidden.append(fork._catch_up(job.context, features[i]))
            seconds[i] += time.perf_counter() - started
        lead, steps = forks[0], max(job.k for job in jobs)
        state = torch.cat(hidden)  # [B, d]: each row's output at its last entry
        lengths = [fork.cache.get_seq_length() for fork in forks]
        if steps > 1:
            cache, mask = lead._side_by_side([fork.cache for fork in forks], lengths)
            positions = torch.tensor(lengths, device=state.device)[:, None]
        rows = list(range(len(jobs)))  # the jobs still drafting, in the order of the tensors' rows
        for j in range(steps):
            started = time.perf_counter()
            if j:
                keep = [p for p, i in enumerate(rows) if jobs[i].k > j]
                if len(keep) < len(rows):  # a row whose draft is done leaves the steps
                    index = torch.tensor(keep, device=state.device)
                    state, mask, positions = state[index], mask[index], positions[index]
                    cache.batch_select_indices(index)
                    rows = [rows[p] for p in keep]
                tokens = torch.tensor([[built[i].tokens[-1]] for i in rows], device=state.device)
                step_mask = torch.cat([mask, mask.new_zeros(len(rows), 1, 1, j)], dim=-1)
                state = lead.head(
                    state.unsqueeze(1),
                    lead.embed(tokens),
                    cache=cache,
                    position_ids=positions + j - 1,
                    attention_mask=step_mask,
                )[:, -1]
            logits = lead._logits(state)
            for p, i in enumerate(rows):
                q = probabilities(logits[p : p + 1], jobs[i].params)[0]
                built[i].forwards += 1
                built[i].add(q, pick(q, jobs[i].params, jobs[i].generator))
            for i in rows:
                seconds[i] += (time.perf_counter() - started) / len(rows)
        return [(b.draft(), t) for b, t in zip(built, seconds, strict=True)]

    def _side_by_side(self, caches: list[DynamicCache], lengths: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """One cache holding, in each of the head's decoder layers, each row's entries at [0, length), zeros after up
        to the longest, and the additive mask [B, 1, 1, longest] that hides those zeros."""
        longest = max(lengths)
        side = DynamicCache(config=self.head.body.config)
        for depth in range(len(caches[0].layers)):  # the head's decoder layers
            layer = caches[0].layers[depth]
            keys = layer.keys.new_zeros(len(caches), *layer.keys.shape[1:2], longest, layer.keys.shape[-1])
            values = torch.zeros_like(keys)
            for row, (cache, length) in enumerate(zip(caches, lengths, strict=True)):
                keys[row, :, :length] = cache.layers[depth].keys[0, :, :length]
                values[row, :, :length] = cache.layers[depth].values[0, :, :length]
            side.update(keys, values, depth)
        mask = keys.new_full((len(caches), 1, 1, longest), float("-inf"))
        for row, length in enumerate(lengths):
            mask[row, ..., :length] = 0.0
        return side, mask

    @torch.inference_mode()
    def _catch_up(self, context: list[int], features: torch.Tensor) -> torch.Tensor:
        """Entries for pairs (f_i, context[i + 1]) up to the last one; returns the head's output there [1, d]."""
        valid = min(self.exact, common_prefix(self.pairs, context[1:]))
        end = len(context) - 1
        valid = min(valid, end - 1)  # the last entry is always run: its output predicts the first draft token
        if valid <= 0:
            self.reset_cache()
            valid = 0
        elif valid < self.cache.get_seq_length():
            self.cache.crop(valid - self.cache.get_seq_length())
        ids = torch.tensor([context[valid + 1 : end + 1]], device=features.device)
        true = features[valid:end] if self._columns is None else features[valid:end, self._columns]
        hidden = self.exact_head(self.exact_head.fuse(true.unsqueeze(0)), self.embed(ids), cache=self.cache)
        self.pairs = list(context[1 : end + 1])
        self.exact = end
        return hidden[:, -1]

    @torch.inference_mode()
    def _step(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        ids = torch.tensor([[token]], device=hidden.device)
        out = self.head(hidden.unsqueeze(1), self.embed(ids), cache=self.cache)
        self.pairs.append(token)
        return out[:, -1]

    @torch.inference_mode()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V] on the CPU from hidden [B, d]: the draft vocabulary's, -inf elsewhere (q is
        0 there)."""
        logits = torch.full((hidden.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head.draft_vocab.cpu()] = self.readout(hidden).float().cpu()
        return logits


def build_eagle(arg: str, target) -> EagleDrafter:
    """`eagle[:PATH][:WEIGHTS]`: a head directory from `metasd train-eagle`, or with no path the head shipped for
    this target; WEIGHTS (`auto`, `int8`, `unquantized`) are a draft step's, as `EagleDrafter` explains."""
    head_dir, weights = split_weights(arg)
    if head_dir:
        path = Path(head_dir).expanduser()
    else:
        path = shipped_head(target.model)
        if path is None:
            raise ValueError(
                f"metasd ships no EAGLE head for {target.spec!r}; train one with `metasd train-eagle --target "
                f"{target.spec}` and use eagle:PATH"
            )
    try:
        saved = load_head(path, target.model)
    except ValueError as err:
        tail = head_dir.rpartition(":")[2]
        if tail != head_dir and "/" not in tail and "\\" not in tail:  # eagle:DIR:int4: a mistyped word?
            raise ValueError(f"{err} (after eagle:DIR, a ':' suffix names the weights: {', '.join(WEIGHTS)})") from err
        raise
    return EagleDrafter(
        saved.head,
        target.model,
        name="eagle" if not arg else f"eagle:{arg}",
        vocab_size=target.vocab_size,
        weights=weights or "auto",
    )
