"""A causal LM with its own KV cache that always mirrors a token list it can compare with the true context.

Both the target and the model-based drafters use it. Instead of callers cropping by hand after every rejection,
`logits_for` compares the tokens it has cached with the tokens asked for, crops to the common prefix and feeds only
the rest: a cache can never drift from the context, and a drafter that sat out rounds catches up the same way.

A draft tree (`logits_for_tree`) leaves the KV entries of every node behind the context; the next call that names
the context it wants keeps those of the path that context follows through the tree (gathered, the rest dropped),
so after a tree round, too, the cache holds exactly the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .models.features import feature_tap
from .models.logits import fit_vocab
from .tokens import common_prefix
from .tree import DraftTree


class TargetCache(Protocol):
    """A request's handle in the target's KV cache, which mirrors a token list (it keeps the cached prefix a new
    context shares and feeds the rest: no caller crops): `CachedModel` for a request decoding alone (its own
    `round.Verifier`), a batch's row (`slots.Row`, verified by `BatchedTarget`) for one of many."""

    fed_tokens: int  # tokens fed to the model so far (a prefill shows as more than a round's tree)
    keep_features: bool
    feature_layers: tuple[int, ...]

    def reset(self) -> None:
        """Empty the cache: a new request starts from no tokens."""

    def features_for(self, tokens: list[int]) -> torch.Tensor:
        """The target's features [n, D] for the longest prefix of `tokens` computed."""
        ...


class CachedModel:
    """keep_features: also keep the model's features (`feature_tap`: the outputs of `feature_layers`, then of the
    final norm) for every cached position, cropped with the cache, for drafters that read them (EAGLE heads):
    `features_for`."""

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int | None = None,
        keep_features: bool = False,
        feature_layers: Sequence[int] = (),
    ):
        self.model = model
        self.vocab_size = vocab_size  # pad/trim logits to the target's vocabulary when the heads differ in size
        self.tokens: list[int] = []
        self.cache = DynamicCache(config=model.config)
        self.fed_tokens = 0  # tokens run through the model since the last reset (prefill + catch-up + drafts)
        self.keep_features = keep_features
        self.feature_layers = tuple(feature_layers)
        self.features: torch.Tensor | None = None  # [capacity, d * (len(feature_layers) + 1)]; rows of `tokens`
        self._tree: DraftTree | None = None  # a verified tree whose nodes' entries follow `tokens` in the cache
        # The forward runs where the weights are (CPU, CUDA, MPS); its [last, V] logits come back to the CPU. The
        # acceptance rule, rewards and sampling then see only small CPU tensors and one CPU generator, so a seed
        # draws the same numbers on every device and no caller has to track devices.
        self.device = next(model.parameters()).device

    def features_for(self, tokens: list[int]) -> torch.Tensor:
        """The features [n, D] of the longest prefix of `tokens` this model has computed (on the model's device)."""
        if self.features is None:
            return torch.empty(0, 0)
        self._settle(tokens)
        return self.features[: common_prefix(self.tokens, tokens)]

    def reset(self) -> None:
        """Forget every cached token: a new request starts from an empty cache."""
        self.tokens = []
        self._tree = None
        self.cache = DynamicCache(config=self.model.config)
        self.fed_tokens = 0

    @torch.inference_mode()
    def logits_for(self, tokens: list[int], last: int = 1) -> torch.Tensor:
        """Logits [last, V] predicting the token after each of the final `last` positions of `tokens`."""
        if not 1 <= last <= len(tokens):
            raise ValueError(f"need 1 <= last <= {len(tokens)}, got {last}")
        keep = self._reuse(tokens, last)
        new = tokens[keep:]
        out = self._forward(torch.tensor([new], device=self.device), keep, last=last)
        if self.cache.get_seq_length() != len(tokens):
            # e.g. a transformers release whose forward ignores `cache=`: decoding would go on from garbage
            raise RuntimeError(
                f"the KV cache holds {self.cache.get_seq_length()} tokens after a forward that "
                f"should leave {len(tokens)}; this transformers version is not supported"
            )
        self.tokens = list(tokens)
        self.fed_tokens += len(new)
        return self._logits(out)

    def forward(
        self, items: list[tuple[CachedModel, list[int], DraftTree]], prefill: Sequence = ()
    ) -> list[torch.Tensor]:
        """A batch of one (`round.Verifier`): the logits of `logits_for_tree` for this model's one request."""
        if len(items) != 1 or items[0][0] is not self or prefill:
            raise ValueError("a CachedModel verifies its own request alone")
        _, context, tree = items[0]
        return [self.logits_for_tree(context, tree)]

    @torch.inference_mode()
    def logits_for_tree(self, context: list[int], tree: DraftTree) -> torch.Tensor:
        """Logits [1 + tree.size, V]: row 0 after the context, row 1 + i after node i (its path from the root).
        One forward with the tree mask; the next call settles the cache on the path the context then follows."""
        if tree.is_chain:
            return self.logits_for(context + tree.tokens, last=tree.size + 1)
        if not all(type(layer).crop is DynamicLayer.crop for layer in self.cache.layers):
            raise ValueError("draft trees need a cache of plain (not sliding-window) layers to keep one path")
        keep = self._reuse(context, 1)
        pending = context[keep:]
        dtype = next(self.model.parameters()).dtype
        mask, positions = tree.attention(keep, len(pending), dtype, self.device)
        ids = torch.tensor([pending + tree.tokens], device=self.device)
        out = self._forward(ids, keep, last=tree.size + 1, attention_mask=mask, position_ids=positions)
        if self.cache.get_seq_length() != len(context) + tree.size:
            raise RuntimeError("the KV cache does not hold the context and the tree after a tree forward")
        self.tokens = list(context)
        self.fed_tokens += len(pending) + tree.size
        self._tree = tree
        return self._logits(out)

    def _reuse(self, tokens: list[int], last: int) -> int:
        """Cached tokens kept for a forward over `tokens`: the prefix they share with the cache (any tree settled
        first), leaving at least the final `last` to feed, whose logits are asked for. The cache is cropped to it."""
        self._settle(tokens)
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - last)
        if keep < len(self.tokens):
            self.cache.crop(keep - len(self.tokens))
        return keep

    @torch.inference_mode()
    def _settle(self, tokens: list[int]) -> None:
        """After a tree forward: keep the entries of the longest tree path `tokens` follows, drop the others."""
        tree, self._tree = self._tree, None
        if tree is None:
            return
        base = len(self.tokens)
        path = tree.follow(tokens[base:]) if tokens[:base] == self.tokens else []
        # the path's entries moved behind the context in place, the rest cut off by a view: no copy of the context's
        index, end = torch.tensor([base + n for n in path], dtype=torch.long, device=self.device), base + len(path)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys[..., base:end, :] = layer.keys[..., index, :]
                layer.values[..., base:end, :] = layer.values[..., index, :]
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if self.features is not None:
            self.features[base:end] = self.features[index]
        self.tokens = self.tokens + tree.path_tokens(path)

    def _forward(self, ids: torch.Tensor, keep: int, last: int, **kwargs):
        """The model's forward over `ids` after `keep` cached tokens; with keep_features, their features are kept
        in `features[keep:]`."""
        if not self.keep_features:
            return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=last, **kwargs)
        with feature_tap(self.model, self.feature_layers) as tapped:
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=last, **kwargs)
            new = tapped()[0]
        end = keep + new.shape[0]
        if self.features is None or self.features.shape[0] < end:
            grown = torch.empty(max(2 * end, 256), new.shape[-1], dtype=new.dtype, device=new.device)
            if self.features is not None:
                grown[:keep] = self.features[:keep]
            self.features = grown
        self.features[keep:end] = new
        return out

    def _logits(self, out) -> torch.Tensor:
        logits = out.logits[0].float().cpu()  # the acceptance rule works on the CPU (see __init__)
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = fit_vocab(logits, self.vocab_size)
        return logits
