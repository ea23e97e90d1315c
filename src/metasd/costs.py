"""What a round costs on this machine: the target's forward time T(M) for M new tokens, and each drafter's time.

T(M) is neither linear nor monotonic in M and differs widely between machines (vector units, thread count, dtype),
so it is measured, never assumed: `calibrate` times cached forwards of M = 1 .. max new tokens at load under each
linear kernel of `metasd.models.linear_kernels` and routes each M to the faster (cached on disk per model, dtype,
thread count and machine; `metasd calibrate` prints the table), and `TargetCost.observe` keeps refining it from
every round's measured verification time. Drafter costs are learned online only: seconds per drafted token, and the
time to take in unseen tokens (a model drafter's prompt on its first draft of a request, then what it missed while
others drafted).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from .models.embedded import cache_dir
from .models.linear_kernels import KERNELS, install
from .round import RoundClock


class _Mean:
    """A running mean that turns into an exponential moving average after 1/alpha observations: early estimates
    use every sample, later ones follow drift (thermal, contention, a longer context)."""

    def __init__(self, alpha: float = 0.05):
        self.value: float | None = None
        self.alpha, self.n = alpha, 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.value is None:
            self.value = x
            return
        if self.value > 0:
            x = min(x, 4 * self.value)  # one preempted round must not wreck the estimate
        self.value += max(self.alpha, 1 / self.n) * (x - self.value)


class TargetCost:
    """T(M): the calibrated table, scaled to the machine as it runs now and corrected per M from real rounds.

    Two robust statistics, so that a burst of slow rounds (another process competing for the CPU) cannot drag the
    estimates far, and they come back once the machine is quiet:

    - the scale, from plain steps (M = 1) alone: the median of the recent ratios measured / calibrated T(1). It
      tracks the machine (load, clocks) and never absorbs a change of shape: if 12-token forwards turn out dear,
      that must not make 1-token steps look dear too;
    - per M, once `TRUSTED` real rounds are recent enough, the median of their times (real rounds include the
      context's attention and logits processing that calibration does not). Samples older than `MAX_AGE` rounds
      expire, so an M that looked dear during a burst and was avoided since falls back to the scaled calibration.

    `plain_step_due` asks for an occasional plain step so that M = 1 stays measured under a policy that always drafts.
    """

    TRUSTED = 3  # recent rounds at one M before their median replaces the scaled calibrated value
    WINDOW = 9  # rounds per M behind a median: a burst shorter than half of it moves nothing
    MAX_AGE = 200  # rounds after which an observation expires
    RECHECK = 100  # rounds after which T(1) is measured again

    def __init__(self, calibrated: list[float], plain_steps: bool = True):
        if not calibrated or any(not t > 0 for t in calibrated):
            raise ValueError("a calibration table needs positive times for M = 1 ..")
        self.calibrated = list(calibrated)
        self.plain_steps = plain_steps  # its owner takes a plain step when `plain_step_due` (see `scale`)
        self._recent: list[deque[tuple[int, float]]] = [deque(maxlen=self.WINDOW) for _ in calibrated]
        self._round = 0
        self._last_plain = -self.RECHECK

    @property
    def max_tokens(self) -> int:
        """The largest M the table was calibrated for."""
        return len(self.calibrated)

    def _fresh(self, i: int) -> list[float]:
        return [seconds for when, seconds in self._recent[i] if self._round - when < self.MAX_AGE]

    def scale(self) -> float:
        """Measured / calibrated T(1) as the machine runs now (1 before any plain step). For a table whose owner
        takes no plain steps (`plain_steps` False: a batch's T(B, W), where nothing forces a plain round), the
        median ratio over every width measured recently, so that unmeasured widths follow the machine rather than
        keep idle-machine values beside measured ones."""
        plain = self._fresh(0)
        if plain:
            return statistics.median(plain) / self.calibrated[0]
        if self.plain_steps:
            return 1.0
        ratios = [seconds / self.calibrated[i] for i in range(self.max_tokens) for seconds in self._fresh(i)]
        return statistics.median(ratios) if ratios else 1.0

    def __call__(self, m: int) -> float:
        i = min(max(m, 1), self.max_tokens) - 1
        recent = self._fresh(i)
        if len(recent) >= self.TRUSTED:
            return statistics.median(recent)
        return self.calibrated[i] * self.scale()

    def observe(self, m: int, seconds: float) -> None:
        """A real round's forward over `m` new tokens took `seconds` (ignored outside the calibrated range)."""
        if not 1 <= m <= self.max_tokens or not seconds > 0:
            return
        self._round += 1
        self._recent[m - 1].append((self._round, seconds))
        if m == 1:
            self._last_plain = self._round

    def observations(self) -> int:
        """Rounds observed so far."""
        return self._round

    def plain_step_due(self) -> bool:
        """Whether T(1) was last measured `RECHECK` or more rounds ago, so that a plain step should measure it."""
        return self._round - self._last_plain >= self.RECHECK

    def table(self) -> list[float]:
        """T(M) in seconds for M = 1 .. `max_tokens`, as estimated now."""
        return [self(m) for m in range(1, self.max_tokens + 1)]


class _Line:
    """A least-squares line y = a + b n with a, b >= 0 over decayed observations: the time a model drafter takes to
    take in n tokens it has not seen. One forward carries them all, so a few missed tokens cost about a fixed
    forward (a), a fraction of a drafting step, while a prompt of hundreds costs per token (b) and can add up to
    several target steps: neither a per-token rate nor a fixed cost alone prices both."""

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
        """Seconds to take in `missed` unseen tokens; until measured, guessed cheap from `t1`, the target's T(1)."""
        if missed <= 0:
            return 0.0
        return self.catch_up(missed) if self.catch_up.measured else 0.01 * t1 * missed

    def observe(self, forwards: int, missed: int, seconds: float) -> None:
        """A draft that ran `forwards` forwards, the first also taking in `missed` unseen tokens, in `seconds`."""
        if forwards <= 0:
            return
        if missed <= 1:
            self.step.add(seconds / forwards)
        elif self.step.value is not None:  # until a step is measured, intake and drafting cannot be told apart
            self.catch_up.add(missed, max(seconds - forwards * self.step.value, 0.0))


REGIMES = ("greedy", "sampled")


class CostModel:
    """The machine's costs, shared by every request of a Decoder: T(M) (the target's forward alone), drafters, and
    per decoding regime the per-round overhead that a plain target step pays too: proposals, policy, bookkeeping,
    and the acceptance rule with its logits processing (sampling sorts the vocabulary at every verified row; greedy
    takes an argmax)."""

    def __init__(self, target: TargetCost):
        self.target = target
        self.drafters: dict[str, DrafterCost] = {}
        self.overhead = {regime: _Mean() for regime in REGIMES}

    def drafter(self, name: str) -> DrafterCost:
        """The costs of drafter `name`, created unmeasured on first use."""
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
    """Where the calibration measured under `key` (`calibration_key`) is cached on disk."""
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


# --- a round's costs ---------------------------------------------------------------------------------------------


def reward_times(
    costs: CostModel | None,
    clock: RoundClock,
    proposal_time: float,
    verified: int,
    prefilled: bool,
    fresh_drafter: str | None,
    forwards: int,
) -> dict[str, float]:
    """The times a policy's reward sees: what the round costs in steady state. A prompt prefill (the target's, or a
    fresh model drafter's first draft taking in its own copy: `fresh_drafter`, its name, drafting in `forwards`
    forwards) is replaced by the cost model's estimate of the same round without it, as T(M) and the step costs
    leave prefills out."""
    draft_time, verify_time = proposal_time + clock.draft_seconds, clock.verify_seconds
    if costs is None:
        return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": 0.0}
    if prefilled:
        verify_time = costs.target(verified + 1) + clock.accept_seconds
    if fresh_drafter is not None:
        draft_time = forwards * costs.drafter(fresh_drafter).step_time(costs.target(1))
    return {"draft_time": draft_time, "verify_time": verify_time, "plain_step_time": costs.target(1)}


def observe_round(
    costs: CostModel | None,
    clock: RoundClock,
    regime: str,
    verified: int,
    unmeasured: bool,
    drafter: str | None = None,
    forwards: int = 0,
    taken_in: int = 0,
) -> None:
    """The machine's costs, whatever the policy: every round is a measurement (but prefills and batch rounds,
    which measure other shapes: `unmeasured`). T(M) is the forward alone; the acceptance rule, processing and
    bookkeeping go to the regime's per-round overhead; the drafter that drafted after the choice (`drafter`, in
    `forwards` forwards after taking in `taken_in` tokens; not a proposal made before it) adds to its costs."""
    if costs is None:
        return
    if drafter is not None:
        costs.drafter(drafter).observe(forwards, taken_in, clock.draft_seconds)
    if not unmeasured:
        costs.target.observe(verified + 1, clock.forward_seconds)
        costs.overhead[regime].add(max(clock.total_seconds - clock.draft_seconds - clock.forward_seconds, 0.0))
