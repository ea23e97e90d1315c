"""Three ways to multiply the target's weights by M rows, and a per-row-count choice between them.

A verification forward multiplies every weight matrix by M rows, one per drafted token, and how T(M) grows with M
decides whether a draft pays. `F.linear` (x @ W^T, MKL on x86 CPUs) can run far below the memory bandwidth a small
model's forward is bound by at a handful of rows. "weight-major" computes (W @ x^T)^T, reading the weights in their
stored order (a single row padded with a zero row: one column would take BLAS's matrix-vector path). "onednn" hands
the product to oneDNN on a copy of the weight reordered once into its blocked layout (made on first use, again if
the weight changes; it costs the weight's memory once more): MKL picks its code path by CPU vendor and runs without
AVX-512 on other vendors' CPUs, where oneDNN reads the CPU's features. Which wins depends on the BLAS, the CPU, the
dtype and M, so nothing here assumes a winner: calibration (`metasd.costs.calibrate`) times a whole forward under
each kernel for every M it needs and for a prefill, and `install` routes each row count to the faster one.

The kernels compute the same dot products, summed in a different order, so they differ in the last bits only, as
any two BLAS kernels do; the target's own greedy decoding uses the same routed layers as verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)
# KERNELS[0] is torch's own, the default for row counts beyond the measured table
KERNELS = ("linear", "weight-major", *(("onednn",) if ONEDNN else ()))
# A decoder's `kernels` option: the candidates its calibration may choose from ("torch": torch's F.linear only,
# for logits bit-identical to an unrouted model's)
KERNEL_MODES = {"auto": KERNELS, "torch": KERNELS[:1]}
# the dtypes whose products may go to oneDNN: bfloat16 only where the CPU has the instructions its bfloat16 kernels
# need (AVX-512 or AMX), none in a torch build without oneDNN (a model pickled elsewhere may still name the kernel)
ONEDNN_BF16 = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
ONEDNN_DTYPES = (torch.float32, *((torch.bfloat16,) if ONEDNN_BF16 else ())) if ONEDNN else ()


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
    working: a closure stored on the layer would keep pointing at the original's weights after a deepcopy. The
    oneDNN copy of the weight is left out of copies and pickles (it cannot be copied) and made again on use."""

    routes: list[str]  # [M - 1]: the kernel for M rows; one list shared by a model's layers
    beyond: str  # the kernel for more rows than `routes` covers (prefills, wide batches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernel = self.routes[rows - 1] if 1 <= rows <= len(self.routes) else self.beyond
        if kernel == "weight-major":
            return _weight_major(x, self.weight, self.bias)
        if kernel == "onednn" and x.dtype in ONEDNN_DTYPES and x.device.type == "cpu" and not _tracks_grad(x, self):
            # elsewhere (a GPU, a dtype oneDNN's CPU kernels lack, autograd) the product is torch's own
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn_weight(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _onednn_weight(self) -> torch.Tensor:
        """The weight in oneDNN's layout, reordered again whenever the weight was replaced or written to (an
        inference tensor, made under `torch.inference_mode`, counts no writes: only its replacement is seen)."""
        weight = self.weight
        version = (weight.data_ptr(), weight.dtype, None if weight.is_inference() else weight._version)
        packed = self.__dict__.get("_onednn")
        if packed is None or packed[0] != version:
            packed = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
            self.__dict__["_onednn"] = packed
        return packed[1]

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state.pop("_onednn", None)
        return state


def _tracks_grad(x: torch.Tensor, layer: torch.nn.Linear) -> bool:
    """Whether autograd records this product (training a head): oneDNN's op has no backward."""
    trainable = layer.weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad)
    return torch.is_grad_enabled() and (x.requires_grad or trainable)


def install(model: torch.nn.Module, choice: Sequence[str], beyond: str = KERNELS[0], keep: bool = False) -> None:
    """Route every plain `nn.Linear` of `model` by row count: M rows use choice[M - 1], more rows `beyond`.

    Subclasses (quantized layers, LoRA) keep their own forward. Calling again replaces the choice, and drops the
    oneDNN copies of the weights where no row count uses them any more, unless `keep` (a calibration switching
    between kernels, which must not time the reordering)."""
    unknown = {*choice, beyond} - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown linear kernels {sorted(unknown)}; choose from {KERNELS}")
    routes = list(choice)
    torch_only = set(routes) <= {KERNELS[0]} and beyond == KERNELS[0]
    if torch_only and installed(model) is None:  # torch's own everywhere: a model never routed is left as it is
        return  # (a caller's own model object, `Decoder(target=model)`)
    for layer in model.modules():
        if type(layer) in (torch.nn.Linear, RoutedLinear):
            layer.__class__ = RoutedLinear
            layer.routes, layer.beyond = routes, beyond
            if not keep and "onednn" not in (*routes, beyond):
                layer.__dict__.pop("_onednn", None)


def installed(model: torch.nn.Module) -> list[str] | None:
    """The choice in force per row count (None when `install` was never called): what the bench reports."""
    layer = next((m for m in model.modules() if isinstance(m, RoutedLinear)), None)
    return None if layer is None else list(layer.routes)


def installed_beyond(model: torch.nn.Module) -> str | None:
    """The kernel in force for row counts past the routed ones (None when `install` was never called)."""
    layer = next((m for m in model.modules() if isinstance(m, RoutedLinear)), None)
    return None if layer is None else layer.beyond
