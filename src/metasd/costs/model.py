"""The machine's costs as the decisions see them: T(B, W), the target's forward over B rows of W new tokens each,
of which one request's T(M) is the B = 1 row; each drafter's step and catch-up time; the per-round overhead.

T is neither linear nor monotonic in W and differs widely between machines (vector units, thread count, dtype), so
it is measured, never assumed (`metasd.costs.calibration`), and every real round's forward refines it
(`TargetCost.observe`). Drafter costs are learned online only: seconds per drafted token, and the time to take in
unseen tokens (a model drafter's prompt on its first draft of a request, then what it missed while others drafted).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
    """The machine's costs, shared by every request of a Decoder: T(B, W) (the target's forward alone; `target` is
    its B = 1 row, T(M)), drafters, and per decoding regime the per-round overhead that a plain target step pays
    too: proposals, policy, bookkeeping, and the acceptance rule with its logits processing (sampling filters
    and draws at every verified row; greedy takes an argmax)."""

    def __init__(self, target: TargetCost):
        self.target = target  # T(1, W) = T(M), replaced when the decoder extends its range
        self.rows: dict[int, TargetCost] = {}  # T(B, W) for B = 2 .. the largest batch (`add_batch_tables`)
        self.drafters: dict[str, DrafterCost] = {}
        self.overhead = {regime: _Mean() for regime in REGIMES}

    def add_batch_tables(self, tables: dict[int, list[float]], max_batch: int) -> None:
        """T(B, W) for B = 2 .. max_batch from the tables calibrated at some sizes (`calibration.batch_sizes`),
        interpolated between the nearest calibrated ones; sizes already known over as many widths keep what rounds
        taught them."""
        known = sorted(tables)
        for b in range(2, max_batch + 1):
            if self.covers(b, len(tables[known[0]])):
                continue
            lower = max((s for s in known if s <= b), default=known[0])
            upper = min((s for s in known if s >= b), default=known[-1])
            share = 0.0 if upper == lower else (b - lower) / (upper - lower)
            table = [(1 - share) * lo + share * hi for lo, hi in zip(tables[lower], tables[upper], strict=True)]
            self.rows[b] = TargetCost(table, plain_steps=False)  # nothing forces a plain round in a batch

    def covers(self, max_batch: int, max_width: int) -> bool:
        """Whether T(B, W) is known for B = 2 .. max_batch and W = 1 .. max_width (no calibration needed)."""
        return all(b in self.rows and self.rows[b].max_tokens >= max_width for b in range(2, max_batch + 1))

    def _row(self, size: int) -> TargetCost:
        return self.target if size <= 1 or not self.rows else self.rows[min(size, max(self.rows))]

    def forward(self, size: int, width: int) -> float:
        """T(B, W) in seconds: one forward over `size` rows padded to `width` new tokens each."""
        return self._row(size)(width)

    def forward_widths(self, size: int, max_width: int) -> list[float]:
        """[T(size, 1), ..., T(size, max_width)]: one round's lookups at once."""
        return [self.forward(size, w) for w in range(1, max_width + 1)]

    def observe_forward(self, size: int, width: int, seconds: float) -> None:
        """A real forward over `size` rows of `width` new tokens took `seconds` (a batch's, where no batch table is
        known, is not taken for one request's)."""
        if size <= 1 or self.rows:
            self._row(size).observe(width, seconds)

    def drafter(self, name: str) -> DrafterCost:
        """The costs of drafter `name`, created unmeasured on first use."""
        return self.drafters.setdefault(name, DrafterCost())
