"""Two ways to multiply the target's weights by a few rows, and a per-row-count choice between them.

A verification forward multiplies every weight matrix by M rows, one per drafted token. `F.linear` computes
x @ W^T; on CPUs its BLAS call for a handful of rows can run far below the memory bandwidth that a forward of a
small model is bound by, so a 2-token forward can cost much more than a 1-token one, and that ratio is exactly what
decides whether a draft pays. The same product computed as (W @ x^T)^T reads the weights in their stored order
("weight-major"; a single row is padded with a zero row, as one column takes BLAS's matrix-vector path), which
keeps a few-row forward close to a one-row one where `F.linear` does not. Which layout wins depends on the BLAS,
the CPU, the dtype and M, so nothing here assumes a winner: calibration (`metasd.costs.calibrate`) times a whole
forward under each kernel for every M it needs and `install` routes each row count to the faster one.

Both kernels compute the same dot products, summed in a different order, so they differ in the last bits only,
as any two BLAS kernels do; the target's own greedy decoding uses the same routed layers as verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

KERNELS = ("linear", "weight-major")  # KERNELS[0] is torch's own, used for row counts beyond the measured table
# A decoder's `kernels` option: the candidates its calibration may choose from ("torch": torch's F.linear only,
# for logits bit-identical to an unrouted model's)
KERNEL_MODES = {"auto": KERNELS, "torch": KERNELS[:1]}


def _weight_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1:  # one column would take BLAS's matrix-vector path, which can be slower than a 2-column product
        rows = torch.cat([rows, torch.zeros_like(rows)])
    y = torch.mm(weight, rows.t())[:, :n].t()
    if bias is not None:
        y = y + bias
    return y.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class RoutedLinear(torch.nn.Linear):
    """A `nn.Linear` (same parameters, same state dict) whose forward takes the kernel chosen for its row count.

    `install` swaps the class of existing layers rather than wrapping them, so a copied or pickled model keeps
    working: a closure stored on the layer would keep pointing at the original's weights after a deepcopy."""

    weight_major: list[bool]  # [M - 1]: whether M rows go weight-major; one list shared by a model's layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 1 <= rows <= len(self.weight_major) and self.weight_major[rows - 1]:
            return _weight_major(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, choice: Sequence[str]) -> None:
    """Route every plain `nn.Linear` of `model` by row count: M rows use choice[M - 1], more rows torch's own.

    Subclasses (quantized layers, LoRA) keep their own forward. Calling again replaces the choice."""
    unknown = set(choice) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown linear kernels {sorted(unknown)}; choose from {KERNELS}")
    weight_major = [kernel == "weight-major" for kernel in choice]
    if not any(weight_major) and installed(model) is None:  # torch's own everywhere: a model never routed is left
        return  # as it is (a caller's own model object, `Decoder(target=model)`)
    for layer in model.modules():
        if type(layer) in (torch.nn.Linear, RoutedLinear):
            layer.__class__ = RoutedLinear
            layer.weight_major = weight_major


def installed(model: torch.nn.Module) -> list[str] | None:
    """The choice in force (None when `install` was never called): what the bench reports beside T(M)."""
    layer = next((m for m in model.modules() if isinstance(m, RoutedLinear)), None)
    if layer is None:
        return None
    return [KERNELS[1] if w else KERNELS[0] for w in layer.weight_major]
