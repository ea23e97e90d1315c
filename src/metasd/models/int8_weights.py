"""Weight-only int8 copies of a model drafter's linear layers, used where they are measured faster.

Why: one drafting step of a small LM reads all its weights to produce one token, so on a CPU its time is the time to
stream them from memory, and int8 weights (per-output-channel scales, torch's `_weight_int8pack_mm`, bfloat16
activations) halve that traffic against bfloat16 and quarter it against float32. A drafter's tokens are only
proposals that the target verifies, so approximating its weights cannot change what is generated: greedy output
stays the target's own and sampling keeps its distribution (the acceptance rule uses the q the drafter actually drew
from). What it can change is how often its tokens are accepted, which the benchmark reports side by side.

The quantized model is a twin: it shares every parameter of the model as loaded and holds int8 copies of its plain
linear layers only, so the model itself is untouched (the target, when a drafter names the target's own model, or
Hugging Face's assisted generation). Whether int8 is faster depends on the kernel this torch build has for the
device, on the CPU and on how many rows a product has (a product of many rows, such as a prompt's prefill, is bound
by compute rather than by memory and can run slower in int8), so `auto` times it per row count (`int8_rows`).
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
import torch.nn.functional as F

from .timing import interleaved_medians, seconds

WEIGHTS = ("auto", "int8", "unquantized")  # a model drafter's `weights`; `auto` = int8 where measured faster
ROWS = (1, 2, 4, 8, 16, 32, 64)  # the row counts `auto` times
_CHUNK = 16384  # output rows quantized at a time, so a 150k-row LM head needs no full float32 copy


def split_weights(arg: str) -> tuple[str, str | None]:
    """`MODEL[:WEIGHTS]` (the part of an `lm:` spec after `lm:`) -> (MODEL, WEIGHTS or None). Only a known word
    counts as the suffix: a path may hold colons of its own."""
    model, _, weights = arg.rpartition(":")
    return (model, weights) if weights in WEIGHTS else (arg, None)


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 rows times one bfloat16 scale per row (symmetric, max |w| -> 127).

    Products of more than `int8_rows` rows use the float weight it shares with the model as loaded."""

    int8_rows: int = sys.maxsize

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight  # shared with the model as loaded
        weight = linear.weight.detach()
        self.out_features, self.in_features = rows, _ = weight.shape
        qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
        for start in range(0, rows, _CHUNK):
            block = weight[start : start + _CHUNK].float()
            # rounded to the stored bfloat16 first, so the rows are quantized with the scale the kernel will use
            scale = (block.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.bfloat16).float()
            qweight[start : start + _CHUNK] = (block / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            scales[start : start + _CHUNK] = scale
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = linear.bias  # shared with the model as loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.int8_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def int8_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose plain linear layers (and `RoutedLinear`, the same layer routed) are `Int8Linear`;
    every other parameter is shared with `model`, which is left as it was."""
    from .linear_kernels import RoutedLinear

    shared = {id(p): p for p in model.parameters()}
    twin = copy.deepcopy(model, memo=shared)  # new module objects, the same parameter tensors
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if type(child) in (torch.nn.Linear, RoutedLinear):
                setattr(module, name, Int8Linear(child))
    return twin


@torch.inference_mode()
def forward_seconds(model: torch.nn.Module, rows: int) -> float:
    """One forward over `rows` tokens (no cache): its weight traffic is a drafting step's or a catch-up's."""
    device = next(model.parameters()).device
    ids = torch.ones((1, rows), dtype=torch.long, device=device)
    return seconds(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)


def route_rows(twin: torch.nn.Module, rows: int) -> None:
    """Products of up to `rows` rows on the twin's int8 weights, larger ones on the float weights it shares."""
    for layer in twin.modules():
        if isinstance(layer, Int8Linear):
            layer.int8_rows = rows


def int8_rows(model: torch.nn.Module, twin: torch.nn.Module, reps: int = 3) -> int:
    """The largest of ROWS up to which int8 ran faster, row count after row count (0: not even one row); routes
    the twin to it.

    One row: the twin against the model as loaded. Each larger count R: the twin with products of up to R rows in
    int8 against the same twin with them on the float weights (products up to the previous count in int8), so
    the LM head, which runs one row in both (the last position's logits), cannot hide a loss in the other layers.
    Medians of `reps` forwards after a warm-up, the two interleaved so that a slow spell hits both."""
    faster = 0
    for rows in ROWS:

        def run(which: int, rows: int = rows, faster: int = faster) -> float:
            if faster:
                route_rows(twin, rows if which else faster)
            return forward_seconds(twin if which or faster else model, rows)

        medians = interleaved_medians(run, (0, 1), reps)
        if medians[1] >= medians[0]:
            break
        faster = rows
    route_rows(twin, faster)
    return faster


def drafting_weights(model: torch.nn.Module, weights: str = "auto") -> tuple[torch.nn.Module, str]:
    """The model a drafter should run and what it is ("int8", "int8 up to R rows" or "unquantized").

    `auto` measures in each process (a Decoder's drafters are built once): its choice can differ between runs,
    which changes a sampled output's draws (never its distribution); `int8` or `unquantized` pin it.

    `int8` insists (every product in int8; a ValueError where this torch build has no int8 kernel for the
    device); `auto` builds the twin, routes each row count to the faster weights (`int8_rows`) and falls back to
    the model as loaded where the kernel is missing or int8 is not faster for one row.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"drafter weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "unquantized":
        return model, "unquantized"
    twin = int8_twin(model)
    try:
        forward_seconds(twin, 1)
    except (NotImplementedError, RuntimeError) as err:
        device = next(model.parameters()).device
        if weights == "int8":
            raise ValueError(
                f"int8 drafter weights are not available on {device} with torch {torch.__version__}: {err}"
            ) from err
        warnings.warn(
            f"int8 drafter weights failed on {device} ({err}); drafting on the weights as loaded", stacklevel=2
        )
        return model, "unquantized"
    if weights == "auto":
        rows = int8_rows(model, twin)
        if not rows:
            return model, "unquantized"
        return twin, f"int8 up to {rows} rows"
    return twin, "int8"
