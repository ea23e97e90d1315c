"""The logits a causal LM's own forward makes of final hidden states that a caller computed with its decoder body.

Families differ after the body: Granite divides the logits by `logits_scaling`, HyperCLOVAX multiplies by it,
Cohere by `logit_scale`, Gemma 2/3 soft-cap them, MiniCPM3 scales the hidden states before the head. A caller that
ran the body itself (the batch's KV slots, `metasd.slots`, reads the head only at the positions
verification needs) would sample from another distribution if it applied the LM head alone. Rather than a list of
such rules, the model's own `forward` runs with its decoder stood in for by the hidden states already computed:
whatever the forward does after the body is what these logits get. `metasd.slots.check_batched_logits`
confirms it at start-up on a few tokens, for every architecture.
"""

from __future__ import annotations

import copy

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast


class _BodyOutput(BaseModelOutputWithPast):
    """The stand-in body's output: the hidden states, and None for whatever else a forward reads of its body's
    output (a mixture of experts' `router_logits`, say)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Hidden(torch.nn.Module):
    """Stands in for a decoder body: answers with the hidden states set before the call."""

    def __init__(self):
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> BaseModelOutputWithPast:
        return _BodyOutput(last_hidden_state=self.hidden)


class ModelHead:
    """`head(hidden [n, d]) -> logits [n, V]` as `model(...)` computes them after its decoder body: the model's own
    forward, on a shallow twin of the model (same class, the same submodules and weights) whose decoder is a
    stand-in returning `hidden`. The model itself is never modified. The class's `forward` is called directly, so
    what is set on the model object (an accelerate hook's wrapped `forward`, forward hooks) does not run for the
    twin; the submodules' own hooks (the LM head's) do."""

    def __init__(self, model: torch.nn.Module):
        body = model.get_decoder()
        attribute = next((name for name, child in model.named_children() if child is body), None)
        if attribute is None:
            raise ValueError(
                f"{type(model).__name__}: its decoder (get_decoder()) is not one of its own submodules, so its "
                "logits cannot be taken the way its forward takes them"
            )
        self.body = _Hidden()
        self.twin = copy.copy(model)
        self.twin.__dict__["_modules"] = {**model._modules, attribute: self.body}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.body.hidden = hidden.unsqueeze(0)
        ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)  # read by no decoder
        try:
            out = type(self.twin).forward(self.twin, input_ids=ids, use_cache=False, logits_to_keep=0, return_dict=True)
            return out.logits[0]
        finally:
            self.body.hidden = None


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Logits [n, V'] as [n, size]: a drafter's larger vocabulary cut to the target's, a smaller one padded with
    -inf (its q is 0 there)."""
    if logits.shape[-1] > size:
        return logits[:, :size]
    pad = torch.full((logits.shape[0], size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
