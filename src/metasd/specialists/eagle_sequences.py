"""What EAGLE training reads: token sequences with the target's features at every position (`TokenFeatures`), as a
corpus on disk holds them (`StoredSequences`) or as the target computes them when a batch needs them
(`eagle_prefill.PrefilledSequences`), both behind `TrainingSequences`; a served head's learner reads its buffer
through `StoredSequences` too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TokenFeatures:
    """One prompt + answer: `tokens` [n], `features` [n, D] (the last row is the feature of the last token);
    `prompt`: how many of the tokens are the prompt the target answered (0: a document, every token is text)."""

    tokens: torch.Tensor
    features: torch.Tensor
    prompt: int = 0


class TrainingSequences(Protocol):
    """What training reads: token sequences and, for a batch of them, the target's features at every position.
    `StoredSequences` reads them from a corpus written to disk; `eagle_prefill.PrefilledSequences` has the target
    compute them when a batch needs them."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> TrainingSequences: ...

    def tokens(self, i: int) -> torch.Tensor:
        """Sequence i's tokens."""
        ...

    def feature_width(self) -> int:
        """Columns of a position's features: the fused layers' outputs and the final norm's."""
        ...

    def stack(self, idx: list[int], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded tokens [B, n] (long), features [B, n, D] (float32) and a mask of positions with a real
        feature, for sequences `idx` cut to max_length."""
        ...


def right_padded(token_lists: list[torch.Tensor], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, n] right-padded with 0 and the mask of real positions, each sequence cut to max_length."""
    n = min(max(len(t) for t in token_lists), max_length)
    tokens = torch.zeros(len(token_lists), n, dtype=torch.long)
    real = torch.zeros(len(token_lists), n, dtype=torch.bool)
    for row, t in enumerate(token_lists):
        t = t[:n]
        tokens[row, : len(t)] = t.long()
        real[row, : len(t)] = True
    return tokens, real


@dataclass(frozen=True)
class StoredSequences:
    """A corpus read from disk (`eagle_corpus.read_corpus`): features as the target computed them once.
    answers_only: a sequence's prompt positions are context, not counted (`stack`'s `real` leaves them out): what
    a held-out set of the target's answers measures, since drafting never drafts a prompt."""

    seqs: list[TokenFeatures]
    answers_only: bool = False

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, index: slice) -> StoredSequences:
        return StoredSequences(self.seqs[index], self.answers_only)

    def tokens(self, i: int) -> torch.Tensor:
        """Sequence i's tokens."""
        return self.seqs[i].tokens

    def feature_width(self) -> int:
        """Columns of a position's features."""
        return self.seqs[0].features.shape[1]

    def stack(self, idx: list[int], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, _ = right_padded([self.seqs[i].tokens for i in idx], max_length)
        feats = torch.zeros(*tokens.shape, self.feature_width())
        for row, i in enumerate(idx):
            f = self.seqs[i].features[: tokens.shape[1]]
            feats[row, : len(f)] = f.float()
        real = feats.abs().sum(-1) > 0  # positions whose feature was computed (padding and a final token's are 0)
        if self.answers_only:  # a pair (i, i + 1) counts when token i + 1 is the answer's
            for row, i in enumerate(idx):
                real[row, : max(self.seqs[i].prompt - 1, 0)] = False
        return tokens, feats, real
