"""The target's KV cache for a batch of requests: one row of preallocated slots per request, one forward for all.

Continuous batching (Orca, Yu et al., OSDI 2022) runs every request in flight through one target forward per round
while requests join and leave between rounds. Each request here owns a row of a preallocated key/value buffer
[rows, heads, capacity, head_dim] per layer: a round writes each row's new tokens at that row's own positions
(a scatter, nothing of the cached context is copied) and attends through a 4D additive mask, so rows of different
lengths, each with its own draft (a chain or a draft tree, `metasd.tree`), share one forward padded to the widest;
a forward whose padding would cost more than packing packs every row's tokens instead (`ragged`): a prompt chunk
beside decoding rows, drafts of different lengths, rows fed nothing between fed ones.

A row mirrors a token list exactly as `CachedModel` does: before a forward it keeps the cached prefix the new
context shares (a tree's entries settled on the path the context follows) and feeds the rest, so no caller crops.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..draft import Draft
from ..models.features import feature_tap
from ..models.loading import context_length
from ..models.logits import ModelHead
from ..tokens import common_prefix
from ..tree import DraftTree
from .ragged import Segment, packed


class _SlotLayer(CacheLayerMixin):
    """One layer's key/value slots; `update` writes where its owner says and returns the rows' used span."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: _Slots):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        shape = (self.owner.rows, heads, self.owner.capacity, dim)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape)
        self.device = key_states.device
        self.is_initialized = True

    def resize(self, capacity: int) -> None:
        """Slots for `capacity` positions per row, what the first min(old, new) held kept."""
        if self.is_initialized and self.keys.shape[2] != capacity:
            for name in ("keys", "values"):
                setattr(self, name, _resized(getattr(self, name), 2, capacity))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.packed is not None:  # a ragged forward: token i goes to (rows[i], positions[i])
            rows, positions = self.owner.packed
            self.keys[rows, :, positions] = key_states[0].transpose(0, 1)
            self.values[rows, :, positions] = value_states[0].transpose(0, 1)
            return key_states, value_states  # its attention reads each row's slots (`ragged`)
        first, span, index = self.owner.first, self.owner.span, self.owner.write_index
        rows = slice(first, first + key_states.shape[0])
        index = index[:, None, :, None].expand_as(key_states)
        self.keys[rows].scatter_(2, index, key_states)
        self.values[rows].scatter_(2, index, value_states)
        return self.keys[rows, :, :span], self.values[rows, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        return self.owner.span

    def get_max_length(self) -> int:
        return self.owner.capacity

    def move(self, source, target) -> None:
        """Entries `source` of a row to `target` (a tree path settling; a row moving when another leaves)."""
        if self.is_initialized:
            self.keys[target] = self.keys[source]
            self.values[target] = self.values[source]


class _Slots(Cache):
    """The model-facing cache: the layers, and what the next forward writes where (set by `BatchedTarget`)."""

    def __init__(self, num_layers: int, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.first, self.span = 0, 0
        self.write_index = torch.zeros(0, 0, dtype=torch.long)
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # a ragged forward's (row, position) per token
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        for layer in self.layers:
            layer.resize(capacity)


def _resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` with `size` entries along `dim`: its first ones copied, zeros after."""
    shape = list(tensor.shape)
    keep, shape[dim] = min(shape[dim], size), size
    out = tensor.new_zeros(shape)
    out.narrow(dim, 0, keep).copy_(tensor.narrow(dim, 0, keep))
    return out


class Row:
    """One request's row: the tokens its slots hold (`tokens`, plus a verified tree's nodes until settled).

    It is a `TargetCache`, as `CachedModel` is: `features_for`, `fed_tokens`, `keep_features`, `feature_layers`,
    `reset`; its owner (`BatchedTarget.forward`) verifies it."""

    def __init__(self, owner: BatchedTarget, index: int):
        self.owner, self.index = owner, index
        self.tokens: list[int] = []
        self.tree: DraftTree | None = None
        self.fed_tokens = 0

    @property
    def keep_features(self) -> bool:
        """Whether the batch's forward keeps the target's features (a drafter of the pool reads them)."""
        return self.owner.keep_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs the kept features hold beside the final norm's."""
        return self.owner.feature_layers

    def reset(self) -> None:
        self.tokens, self.tree, self.fed_tokens = [], None, 0

    def features_for(self, tokens: list[int]) -> torch.Tensor:
        """The target's features [n, D] (`feature_tap`) for the longest prefix of `tokens` this row has computed."""
        if self.owner.features is None:
            return torch.empty(0, 0)
        self.owner.settle(self, tokens)
        return self.owner.features[self.index, : common_prefix(self.tokens, tokens)]


class BatchedTarget:
    """The target model over rows of slots: `forward` verifies each row's draft tree after its context, all rows in
    one model call, and may carry chunks of joining rows' prompts beside them. The call pads every row to the
    widest (rows between the ones named ride along, fed nothing) unless padding would feed `PACK_WHEN_PADDED` times
    the rows' own tokens or more: then it packs them (`ragged`), where a row costs its tokens and a little
    attention of its own.

    Memory: a row's slots and features grow with its context, up to the model's context (`context_length`) and a
    round's width past it, and shrink again once the longest request has left; a prompt is prefilled in chunks of
    `PREFILL_CHUNK` tokens, so no mask or attention score is ever [prompt, prompt]."""

    PREFILL_CHUNK = 256
    # padded positions over fed ones from which a packed forward is the faster: its per-row attention costs about
    # what padding to 1.5x does (`experiments/padded_vs_packed.py` measures the two on a machine)
    PACK_WHEN_PADDED = 1.5

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        keep_features: bool = False,
        capacity: int = 256,
        feature_layers: Sequence[int] = (),
    ):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        config = model.config
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
            raise ValueError("batched decoding needs a model whose layers all use full attention (no sliding window)")
        self.model, self.body, self.head = model, model.get_decoder(), ModelHead(model)
        self.context = context_length(config)  # the largest position + 1 any forward may use
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.initial_capacity = capacity
        self.slots = _Slots(config.num_hidden_layers, rows, capacity)
        self.keep_features = keep_features  # as `CachedModel` keeps them
        self.feature_layers = tuple(feature_layers)
        self.features: torch.Tensor | None = None  # [rows, capacity, D]
        self.rows: list[Row | None] = [None] * rows
        # the last `forward`'s positions computed (rows' new tokens and trees, and a padded forward's padding) and
        # seconds
        self.last_forward = (0, 0.0)

    # --- rows ------------------------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """How many rows hold a request now."""
        return sum(r is not None for r in self.rows)

    def add_row(self) -> Row:
        """A free row (the first: rows in use stay consecutive from 0)."""
        index = self.active
        if index == len(self.rows):
            raise RuntimeError(f"all {len(self.rows)} rows are in use")
        row = self.rows[index] = Row(self, index)
        return row

    @torch.inference_mode()
    def remove_row(self, row: Row) -> None:
        """Free a row; the last row in use moves into its place (its slots copied once), keeping rows consecutive.
        Slots that only the row's context needed are given back."""
        last = self.active - 1
        if self.rows[row.index] is not row:
            raise ValueError("this row is not in use")
        if row.index != last:
            moved = self.rows[last]
            for layer in self.slots.layers:
                layer.move(last, row.index)
            if self.features is not None:
                self.features[row.index] = self.features[last]
            moved.index = row.index
            self.rows[row.index] = moved
        self.rows[last] = None
        row.index = -1
        longest = max((len(r.tokens) + (r.tree.size if r.tree else 0) for r in self.rows if r), default=0)
        if self.slots.capacity > max(self.initial_capacity, 4 * longest):
            self._resize(max(self.initial_capacity, 2 * longest))

    def _resize(self, capacity: int) -> None:
        self.slots.resize(capacity)
        if self.features is not None:
            self.features = _resized(self.features, 1, capacity)

    # --- the forward -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def settle(self, row: Row, tokens: list[int]) -> None:
        """After a tree forward: the entries of the path `tokens` follows move behind the context in place."""
        tree, row.tree = row.tree, None
        if tree is None:
            return
        base = len(row.tokens)
        path = tree.follow(tokens[base:]) if tokens[:base] == row.tokens else []
        if path != list(range(len(path))):  # a chain's accepted prefix is in place already
            source = torch.tensor([base + n for n in path], dtype=torch.long, device=self.device)
            target = slice(base, base + len(path))
            for layer in self.slots.layers:
                layer.move((row.index, slice(None), source), (row.index, slice(None), target))
            if self.features is not None:
                self.features[row.index, target] = self.features[row.index, source]
        row.tokens = row.tokens + tree.path_tokens(path)

    @torch.inference_mode()
    def prefill(self, row: Row, context: list[int], tokens: int | None = None) -> bool:
        """Cache all of `context` but its last token in this row alone, so that a round that follows feeds this
        request one token plus its draft, like every other row; tokens: at most this many more now (a chunk of a
        prompt joining a running batch). A long prompt is chunks of `PREFILL_CHUNK` tokens of this row, not a
        wide batch. True once the row holds all but the last token."""
        goal = len(context) - 1
        done = min(common_prefix(row.tokens, context), goal)
        stop = goal if tokens is None else min(goal, done + tokens)
        while done < stop:
            done = min(done + self.PREFILL_CHUNK, stop)
            self._run([(row, context[:done], DraftTree())], logits=False)
        return done >= goal

    @torch.inference_mode()
    def forward(
        self, items: list[tuple[Row, list[int], DraftTree]], prefill: Sequence[tuple[Row, list[int]]] = ()
    ) -> list[torch.Tensor]:
        """Per (row, context, tree): logits [1 + tree.size, V] on the CPU, row 0 after the context and 1 + i after
        node i, as `CachedModel.logits_for_tree` gives them; the row then holds the context (the tree settles at
        its next use). prefill: joining requests' rows and the prompt tokens each should hold after this forward
        (chunks of their prompts sharing the forward). Rows between the ones named (requests still prefilling,
        forks not drafting) are fed nothing."""
        chunks = [(row, tokens, DraftTree()) for row, tokens in prefill]
        started = time.perf_counter()
        logits, computed = self._run(items, logits=True, prefill=chunks)
        self.last_forward = (computed, time.perf_counter() - started)
        return logits

    def _run(self, items, logits: bool, prefill=()) -> tuple[list[torch.Tensor], int]:
        """The verified rows' logits (`forward`), and the positions the model call computed."""
        named = {row.index: item for item in [*items, *prefill] for row in item[:1]}
        if len(named) != len(items) + len(prefill):
            raise ValueError("a forward names a row twice")
        verified = {row.index for row, _, _ in items} if logits else set()
        # the model call takes consecutive rows in order: a row in between that is not named is fed nothing
        span = [
            named.get(i, (self.rows[i], self.rows[i].tokens, DraftTree())) for i in range(min(named), max(named) + 1)
        ]
        for _, context, tree in span:
            if len(context) + max(tree.depths, default=-1) + 1 > self.context:
                raise ValueError(
                    f"a forward over {len(context)} tokens and a draft {max(tree.depths, default=-1) + 1} deep "
                    f"reaches past the {self.context} positions this model is decoded within (`context_length`)"
                )
        feeds, keeps = [], []
        for row, context, _ in span:
            self.settle(row, context)
            keep = min(common_prefix(row.tokens, context), len(context) - (row.index in verified))
            feeds.append(context[keep:])
            keeps.append(keep)
        widths = [len(feed) + tree.size for feed, (_, _, tree) in zip(feeds, span, strict=True)]
        pack = len(span) * max(widths) >= self.PACK_WHEN_PADDED * sum(widths)
        hidden = (self._packed_body if pack else self._body)(span, feeds, keeps) if any(widths) else []
        computed = sum(widths) if pack else len(span) * max(widths)
        out = []
        for (row, context, tree), feed, states in zip(span, feeds, hidden or [None] * len(span), strict=True):
            row.fed_tokens += len(feed) + tree.size
            row.tokens, row.tree = list(context), tree if tree.size else None
            if row.index in verified:
                out.append((row.index, states[len(feed) - 1 : len(feed) + tree.size]))
        if not out:
            return [], computed
        chunks = self.head(torch.cat([states for _, states in out])).float().cpu()  # only what verification reads
        by_row = dict(zip([i for i, _ in out], chunks.split([len(states) for _, states in out]), strict=True))
        return [by_row[row.index] for row, _, _ in items], computed  # in the caller's order

    def _body(self, items, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor]:
        """The decoder's final hidden states [fed, d] of each row's feed and tree: one forward with every row
        padded to the widest."""
        width = max(len(feed) + tree.size for feed, (_, _, tree) in zip(feeds, items, strict=True))
        n, span = len(items), max(keeps) + width
        self._reserve(span)
        ids = torch.zeros(n, width, dtype=torch.long)
        positions = torch.zeros(n, width, dtype=torch.long)
        mask = torch.full((n, 1, width, span), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, :, :, 0] = 0  # padding queries see one slot: no row of the softmax is empty
        for b, ((_, _, tree), feed, keep) in enumerate(zip(items, feeds, keeps, strict=True)):
            fed = len(feed) + tree.size
            ids[b, :fed] = torch.tensor(feed + tree.tokens, dtype=torch.long)
            row_mask, row_positions = tree.attention(keep, len(feed), self.dtype)
            mask[b, 0, :fed, : keep + fed] = row_mask[0, 0]
            positions[b] = (keep + torch.arange(width)).clamp(max=self.context - 1)  # padding stays in range
            positions[b, :fed] = row_positions[0]
        first = items[0][0].index
        self.slots.first, self.slots.span = first, span
        self.slots.write_index = (torch.tensor(keeps)[:, None] + torch.arange(width)).to(self.device)
        hidden = self._call(ids, mask, positions, first, self.slots.write_index)
        return [
            hidden[b, : len(feed) + tree.size] for b, (feed, (_, _, tree)) in enumerate(zip(feeds, items, strict=True))
        ]

    def _packed_body(self, items, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor]:
        """The same states from one packed sequence of every row's tokens, none padded (`ragged`)."""
        lengths = [len(feed) + tree.size for (_, _, tree), feed in zip(items, feeds, strict=True)]
        self._reserve(max(keep + fed for keep, fed in zip(keeps, lengths, strict=True)))
        ids, positions, rows, slots, segments, start = [], [], [], [], [], 0
        for (row, _, tree), feed, keep, fed in zip(items, feeds, keeps, lengths, strict=True):
            if not fed:
                continue
            row_mask, row_positions = tree.attention(keep, len(feed), self.dtype, self.device)
            ids += feed + tree.tokens
            positions.append(row_positions[0])
            rows += [row.index] * fed
            slots.append(torch.arange(keep, keep + fed))
            segments.append(Segment(row.index, start, start + fed, keep + fed, row_mask))
            start += fed
        index = (torch.tensor(rows, device=self.device), torch.cat(slots).to(self.device))
        self.slots.packed = index
        try:
            with packed(self.model, segments, self.slots.layers):
                hidden = self._call(
                    torch.tensor([ids]),
                    torch.zeros(1, 1, 1, 1, dtype=self.dtype),
                    torch.cat(positions)[None],
                    None,
                    index,
                )
        finally:
            self.slots.packed = None
        return list(hidden[0].split(lengths))  # a row fed nothing gets no states

    def _reserve(self, span: int) -> None:
        if span > self.slots.capacity:  # doubling, but never past what the model's context needs
            self._resize(max(span, min(2 * self.slots.capacity, self.context)))

    def _call(self, ids, mask, positions, first, index) -> torch.Tensor:
        """The model's body over `ids` with the slots as its cache; the features kept at `index` (a row range's
        [rows, width] positions from `first`, or a packed forward's (row, position) per token)."""
        inputs = {
            "input_ids": ids.to(self.device),
            "attention_mask": mask.to(self.device),
            "position_ids": positions.to(self.device),
            "cache": self.slots,
            "use_cache": True,
        }
        if not self.keep_features:
            return self.body(**inputs).last_hidden_state
        with feature_tap(self.model, self.feature_layers) as tapped:
            hidden = self.body(**inputs).last_hidden_state
            self._keep_features(tapped(), first, index)
        return hidden

    def _keep_features(self, hidden: torch.Tensor, first: int | None, index) -> None:
        dim = hidden.shape[-1]
        if self.features is None or self.features.shape[1] != self.slots.capacity:
            features = hidden.new_zeros(len(self.rows), self.slots.capacity, dim)
            self.features = features if self.features is None else _resized(self.features, 1, self.slots.capacity)
        if first is None:  # packed: token i at (rows[i], positions[i])
            self.features[index] = hidden[0]
            return
        rows, width, _ = hidden.shape
        self.features[first : first + rows].scatter_(1, index[:, :, None].expand(rows, width, dim), hidden)


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # models that passed `check_batched_logits` (once per model object)


@torch.inference_mode()
def check_batched_logits(model: torch.nn.Module, tolerance: float | None = None) -> None:
    """Refuse, with a clear error, a model whose logits through the batch's slots are not its own forward's: rows
    of different lengths (a chain draft each; padded and packed forwards) against `model(...)` over each row alone.
    Whatever an architecture does that the slots do not reproduce (a transform after the body that `ModelHead`
    misses, an attention that ignores the 4D mask, positions that reach across rows) shows here, at start-up,
    instead of as a silently different distribution. tolerance: of the largest logit (default 1e-3 in float32,
    5e-2 in 16 bits). A model that passed with the default tolerance is not checked again (`metasd.generate` builds a
    batch a call)."""
    if tolerance is None and model in _CHECKED:
        return
    dtype = next(model.parameters()).dtype
    default = tolerance is None
    tolerance = (1e-3 if dtype == torch.float32 else 5e-2) if default else tolerance
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 4, 12, 7)]
    drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in (2, 4, 1, 1)]
    target = BatchedTarget(model, rows=4, capacity=16)
    rows = [target.add_row() for _ in contexts]
    for row, context in zip(rows, contexts, strict=True):
        target.prefill(row, context, tokens=2 if row is rows[2] else None)
    items = [(row, c, DraftTree.chain(Draft(d))) for row, c, d in zip(rows, contexts, drafts, strict=True)]
    # two rows of widths 3 and 5 verified padded; row 3 verified with a chunk of 9 of row 2's prompt tokens beside
    # it, packed (`ragged`); then row 2 verified
    padded = target.forward(items[:2])
    packed = target.forward(items[3:], prefill=[(rows[2], contexts[2][:11])])
    got = padded + target.forward(items[2:3]) + packed
    device = next(model.parameters()).device
    for logits, context, draft in zip(got, contexts, drafts, strict=True):
        ids = torch.tensor([context + draft], device=device)
        want = model(input_ids=ids, use_cache=False).logits[0, len(context) - 1 :].float().cpu()
        error = (logits - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        if not error <= tolerance:
            raise ValueError(
                f"{type(model).__name__}: logits computed for a batch of rows differ from the model's own forward "
                f"by {error:.3g} of the largest logit (allowed {tolerance:g}); decoding through the batch's KV "
                "slots (metasd serve, metasd.generate, Batch) would sample from another distribution, so they refuse "
                "this model; Decoder.generate decodes it through its own forward"
            )
    if default:
        _CHECKED.add(model)
