"""What a round costs on this machine: the target's forward time T(M) for M new tokens, and each drafter's time.

T(M) is neither linear nor monotonic in M and differs by an order of magnitude between machines (vector units,
thread count, dtype), so it is measured, never assumed: `calibrate` times cached forwards of M = 1 .. max new tokens
at load under each linear kernel of `linear_kernels.py` and routes each M to the faster (cached on disk per model,
dtype, thread count and machine; `metasd calibrate` prints the table), and `TargetCost.observe` keeps refining it
from every round's measured verification time. Drafter costs are learned online only: seconds per drafted token,
and the time to take in unseen tokens (a model drafter's prompt on its first draft of a request, then what it
missed while others drafted).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from .models.embedded import cache_dir
from .models.linear_kernels import KERNELS, install


class _Mean:
    """A running mean that turns into an exponential moving average after 1/alpha observations: early estimates
    use every sample, later ones follow drift (thermal, contention, a longer context)."""

    def __init__(self, value: float | None = None, alpha: float = 0.05):
        self.value, self.alpha, self.n = value, alpha, 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.value is None:
            self.value = x
            return
        x = min(x, 4 * self.value)  # one preempted round must not wreck the estimate
        self.value += max(self.alpha, 1 / self.n) * (x - self.value)


class TargetCost:
    """T(M): for an M measured in enough real rounds, their mean (they include the acceptance rule and logits
    processing); otherwise the calibrated value scaled by how real plain steps (M = 1) compare with calibration.

    The scale comes from M = 1 alone so that it tracks the machine (load, clocks) and never absorbs a change of
    shape: if 12-token forwards turn out dear, that must not make 1-token steps look dear too. `plain_step_due`
    asks for an occasional plain step so that M = 1 stays measured under a policy that always drafts.
    """

    TRUSTED = 3  # rounds at one M before their mean replaces the calibrated value
    RECHECK = 100  # rounds after which T(1) is measured again

    def __init__(self, calibrated: list[float]):
        if not calibrated or any(not t > 0 for t in calibrated):
            raise ValueError("a calibration table needs positive times for M = 1 ..")
        self.calibrated = list(calibrated)
        self._online = [_Mean() for _ in calibrated]
        self._rounds_since_plain = self.RECHECK

    @property
    def max_tokens(self) -> int:
        return len(self.calibrated)

    def __call__(self, m: int) -> float:
        i = min(max(m, 1), self.max_tokens) - 1
        online = self._online[i]
        if online.n >= self.TRUSTED:
            return online.value
        plain = self._online[0]
        scale = plain.value / self.calibrated[0] if plain.n else 1.0
        return self.calibrated[i] * scale

    def observe(self, m: int, seconds: float) -> None:
        if not 1 <= m <= self.max_tokens or not seconds > 0:
            return
        self._online[m - 1].add(seconds)
        self._rounds_since_plain = 0 if m == 1 else self._rounds_since_plain + 1

    def plain_step_due(self) -> bool:
        return self._rounds_since_plain >= self.RECHECK

    def table(self) -> list[float]:
        return [self(m) for m in range(1, self.max_tokens + 1)]


class _Line:
    """A least-squares line y = a + b n with a, b >= 0 over decayed observations: the time a model drafter takes to
    take in n tokens it has not seen. One forward carries them all, so a few missed tokens cost about a fixed
    forward (a) and a prompt of hundreds costs per token (b): on the Qwen 0.5B drafter in bfloat16, ~0.9 s for a
    709-token prompt, while the line learned over a run put 10 missed tokens at 7-13 ms (its step: ~60 ms)."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.sums = [0.0] * 5  # weight, n, n^2, y, n y

    @property
    def measured(self) -> bool:
        return self.sums[0] > 0

    def add(self, n: float, y: float) -> None:
        self.sums = [s * self.decay + v for s, v in zip(self.sums, (1.0, n, n * n, y, n * y), strict=True)]

    def __call__(self, n: float) -> float:
        w, sn, snn, sy, sny = self.sums
        det = w * snn - sn * sn
        a = b = 0.0
        if det > 1e-9 * max(w * snn, 1e-30):
            a, b = (snn * sy - sn * sny) / det, (w * sny - sn * sy) / det
        if det <= 1e-9 * max(w * snn, 1e-30) or a < 0:  # one size of catch-up seen, or a line through below 0
            a, b = 0.0, sny / snn if snn > 0 else 0.0
        elif b < 0:
            a, b = sy / w, 0.0
        return max(a + b * n, 0.0)


@dataclass
class DrafterCost:
    """Seconds per drafted token (step) and to take in n unseen tokens (catch-up: what it missed while others
    drafted, or the whole prompt on its first draft of a request); guesses until measured."""

    step: _Mean = field(default_factory=_Mean)
    catch_up: _Line = field(default_factory=_Line)

    def step_time(self, t1: float) -> float:
        """Before any measurement, guess cheap (a quarter of a target step) so that a drafter gets tried, and learn
        its real price from that try."""
        return self.step.value if self.step.value is not None else 0.25 * t1

    def catch_up_time(self, missed: int, t1: float) -> float:
        if missed <= 0:
            return 0.0
        return self.catch_up(missed) if self.catch_up.measured else 0.01 * t1 * missed

    def observe(self, drafted: int, missed: int, seconds: float) -> None:
        if drafted <= 0:
            return
        if missed <= 1:
            self.step.add(seconds / drafted)
        elif self.step.value is not None:  # until a step is measured, intake and drafting cannot be told apart
            self.catch_up.add(missed, max(seconds - drafted * self.step.value, 0.0))


class CostModel:
    """The machine's costs, shared by every request of a Decoder: T(M), drafters, and the per-round overhead
    (proposals, policy, bookkeeping) that a plain target step pays too."""

    def __init__(self, target: TargetCost):
        self.target = target
        self.drafters: dict[str, DrafterCost] = {}
        self.overhead = _Mean(0.0)

    def drafter(self, name: str) -> DrafterCost:
        return self.drafters.setdefault(name, DrafterCost())


# --- calibration -------------------------------------------------------------------------------------------------

CONTEXT = 256  # tokens already in the cache when timing: a typical prompt, so attention is not free


@dataclass(frozen=True)
class Calibration:
    """T(M) in seconds for M = 1 .. len(table), and the linear kernel (`linear_kernels`) each M was fastest under."""

    table: list[float]
    kernels: list[str]


@torch.inference_mode()
def calibrate(
    model: torch.nn.Module, max_tokens: int, context: int = CONTEXT, reps: int = 5, candidates: Sequence[str] = KERNELS
) -> Calibration:
    """Median seconds of a cached forward over M new tokens after `context` cached tokens, M = 1 .. max_tokens,
    under each candidate linear kernel; the faster kernel per M is installed on `model` and its time kept.

    The (M, kernel) pairs are interleaved within each repetition, so a slow spell of the machine hits all alike.
    """
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, context + max_tokens), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    times = {kernel: [[] for _ in range(max_tokens)] for kernel in candidates}
    for rep in range(reps + 1):  # the first pass warms up
        for m in range(1, max_tokens + 1):
            for kernel in candidates:
                install(model, [kernel] * max_tokens)
                start = time.perf_counter()
                model(input_ids=ids[:, context : context + m], cache=cache, use_cache=True, logits_to_keep=m)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                cache.crop(-m)
                if rep:
                    times[kernel][m - 1].append(elapsed)
    medians = {kernel: [statistics.median(t) for t in per_m] for kernel, per_m in times.items()}
    kernels = [min(candidates, key=lambda k, i=i: medians[k][i]) for i in range(max_tokens)]
    install(model, kernels)
    return Calibration([medians[k][i] for i, k in enumerate(kernels)], kernels)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(spec: str, model: torch.nn.Module, max_tokens: int, candidates: Sequence[str] = KERNELS) -> dict:
    """Everything T(M) depends on: a table measured under another key is foreign."""
    import transformers

    device = next(model.parameters()).device
    return {
        "model": spec,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}:{_cpu_name()}",
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "context": CONTEXT,
        "max_tokens": max_tokens,
        "kernels": list(candidates),
    }


def cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def _read(path: Path, key: dict) -> Calibration | None:
    """The cached calibration, or None (with a warning when a file is there but unusable: corrupt or foreign)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("it was measured for another model, dtype or machine")
        table = [float(t) for t in data["table"]]
        kernels = [str(k) for k in data["kernels"]]
        if (
            len(table) != key["max_tokens"]
            or any(not t > 0 for t in table)
            or len(kernels) != len(table)
            or not set(kernels) <= set(key["kernels"])
        ):
            raise ValueError("its table is malformed")
        return Calibration(table, kernels)
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring the calibration cache {path}: {err}", stacklevel=3)
        return None


def load_or_calibrate(
    spec: str, model: torch.nn.Module, max_tokens: int, refresh: bool = False, candidates: Sequence[str] = KERNELS
) -> Calibration:
    """T(M) for M = 1 .. max_tokens from the disk cache, else measured now (seconds) and cached; either way the
    model's linear layers are routed to the kernels the calibration chose among `candidates`."""
    key = calibration_key(spec, model, max_tokens, candidates)
    path = cache_file(key)
    found = None if refresh else _read(path, key)
    if found is not None:
        install(model, found.kernels)
        return found
    found = calibrate(model, max_tokens, candidates=candidates)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"key": key, "table": found.table, "kernels": found.kernels}, indent=1))
        partial.replace(path)
    except OSError as err:  # a read-only home still decodes; it only calibrates again next time
        warnings.warn(f"cannot write the calibration cache {path}: {err}", stacklevel=2)
    return found
