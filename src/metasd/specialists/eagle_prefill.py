"""Training sequences whose target features are computed when a batch needs them, by one prefill: nothing stored.

A corpus on disk holds D floats per token (576 for the embedded model, three times that with EAGLE-3's fused
features: ~35 GB at 10 M tokens in float16). A prefill over existing text gives the same features, and with them
the target's full next-token distribution (the readout of its final-norm feature), at every position in one
forward, at a few times the speed of the target writing its own answers. Streaming them costs one target forward
per position per epoch, which for a corpus as large as the text at hand, read about once, is what storing it
would cost too. The head then learns the target's distribution on that text (soft labels over the draft
vocabulary, as HASS does, arXiv 2408.15766), not the text's own next tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.features import feature_tap
from .eagle_sequences import right_padded


@dataclass(frozen=True)
class PrefilledSequences:
    """Token sequences (`encode_documents`' output) and the target that reads them; `stack` runs its forward over a
    right-padded batch and returns the outputs of `feature_layers` and of the final norm at every position."""

    model: torch.nn.Module
    sequences: list[torch.Tensor]
    feature_layers: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: slice) -> PrefilledSequences:
        return PrefilledSequences(self.model, self.sequences[index], self.feature_layers)

    def tokens(self, i: int) -> torch.Tensor:
        """Sequence i's tokens."""
        return self.sequences[i]

    def feature_width(self) -> int:
        """Columns of a position's features: the fused layers' outputs and the final norm's."""
        return (len(self.feature_layers) + 1) * self.model.config.hidden_size

    @torch.no_grad()  # not inference_mode: the features are inputs of a training graph
    def stack(self, idx: list[int], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, real = right_padded([self.sequences[i] for i in idx], max_length)
        device = next(self.model.parameters()).device
        with feature_tap(self.model, self.feature_layers) as tapped:
            self.model.get_decoder()(
                input_ids=tokens.to(device), attention_mask=real.long().to(device), use_cache=False
            )
            features = tapped().float().cpu()
        return tokens, features * real[..., None], real
