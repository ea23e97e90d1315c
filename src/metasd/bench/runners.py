"""Run one method on one question (all its turns) and record what the timing and the report need.

Every method gets the same prompt ids for turn 1; from turn 2 on the chat history holds the method's own earlier
answers, as Spec-Bench does (greedy decoding is lossless, so they equal `ar`'s unless something is wrong, which
the mismatch count then shows). Wall time is measured around the one call that turns prompt ids into output ids,
the same way for the engine and for transformers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..policy import ArmStats, Policy
from ..stats import Round
from .questions import Question


@dataclass
class TurnRecord:
    """One turn as a method answered it: the prompt and generated ids, the text, the wall time in seconds, the
    tokens gained per target forward, and the engine's round log where there is one."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    wall_time: float
    accept_lengths: list[int]  # tokens gained per target forward, one entry per round (Spec-Bench's convention)
    rounds: list[Round] | None = None  # the engine's round log; None for transformers anchors
    finish_reason: str = ""

    @property
    def new_tokens(self) -> int:
        """The tokens the turn generated."""
        return len(self.token_ids)


@dataclass
class QuestionRecord:
    """A question as a method answered it: a record per turn."""

    question: Question
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        """The tokens generated over all turns."""
        return sum(t.new_tokens for t in self.turns)

    @property
    def wall_time(self) -> float:
        """Seconds over all turns."""
        return sum(t.wall_time for t in self.turns)


TurnRunner = Callable[[list[int], int], TurnRecord]  # (prompt ids, turn index) -> record


def run_question(decoder, question: Question, run_turn: TurnRunner) -> QuestionRecord:
    """Ask each turn with the earlier turns and this method's own answers in the history."""
    record = QuestionRecord(question)
    messages: list[dict] = []
    for index, text in enumerate(question.turns):
        messages.append({"role": "user", "content": text})
        ids = decoder.encode(messages)
        try:
            turn = run_turn(ids, index)
        except ValueError as err:
            raise ValueError(f"question {question.question_id} turn {index + 1}: {err}") from err
        record.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return record


def measure_question(
    decoder,
    question: Question,
    methods: Sequence[str],
    runner: Callable[[str], TurnRunner],
    repeat: int,
    restore: Callable[[], None],
    after_reference: Callable[[QuestionRecord], None] | None = None,
    on_run: Callable[[str], None] | None = None,
) -> dict[str, QuestionRecord]:
    """Every method on one question, in `repeat` passes; the fastest run of each method is its record.

    methods[0] is the reference (`ar`): after its first run, `after_reference` gets it (the oracle tables). Before
    every run `restore` puts the drafters' cross-request history back, and before every pass after the first the
    policies go back to what they knew before the first (a repeat must not learn from the question it is measured
    on). Passes, not back-to-back repeats: a shared machine slows down for spells longer than one run, and a
    method whose tries all fell in one such spell would keep a slow record.
    """
    start = decoder.snapshot_policies() if repeat > 1 else None
    best: dict[str, QuestionRecord] = {}
    for attempt in range(repeat):
        if attempt:
            decoder.restore_policies(start)
        for method in methods:
            if on_run is not None:
                on_run(method)
            restore()
            record = run_question(decoder, question, runner(method))
            if method not in best or record.wall_time < best[method].wall_time:
                best[method] = record
            if attempt == 0 and method == methods[0] and after_reference is not None:
                after_reference(record)
    return best


def engine_turn(decoder, policy: str | Callable[[], Policy], max_new_tokens: int, seed: int | None) -> TurnRunner:
    """A turn through metasd's Decoder with one policy (`none` for `ar`, `fixed:<d>`, a bandit), or a policy object
    made for each turn (the oracle replay's scripted policy)."""

    def run(ids: list[int], turn: int) -> TurnRecord:
        start = time.perf_counter()
        chosen = policy if isinstance(policy, str) else policy()
        generation = decoder.stream(ids, max_new_tokens=max_new_tokens, temperature=0.0, seed=seed, policy=chosen)
        for _ in generation:
            pass
        wall = time.perf_counter() - start
        result = generation.result()
        rounds = list(result.stats.rounds)
        return TurnRecord(
            list(ids),
            list(result.token_ids),
            result.text,
            wall,
            [r.emitted for r in rounds],
            rounds,
            result.finish_reason,
        )

    return run


class _RoundCounter:
    """A transformers streamer that records how many tokens each target forward added (the first put is the prompt)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def hf_turn(
    decoder,
    mode: str,
    max_new_tokens: int,
    draft_len: int,
    assistant: torch.nn.Module | None = None,
    max_ngram: int = 3,
) -> TurnRunner:
    """A turn through transformers' own `generate` on the same target weights, greedy.

    mode `ar`: plain greedy; `pld`: prompt lookup (`prompt_lookup_num_tokens=draft_len`, n-grams up to `max_ngram`);
    `assisted`: `assistant_model` drafting a constant `draft_len` tokens a round (no confidence cut-off), i.e. the
    same algorithm as `fixed:lm:...` in metasd.
    """
    if mode not in ("ar", "pld", "assisted"):
        raise ValueError(f"unknown transformers mode {mode!r}")
    if mode == "assisted" and assistant is None:
        raise ValueError("hf-assisted needs an assistant model (an lm: drafter)")
    model = decoder.target.model
    eos = sorted(decoder.target.eos_token_ids)
    pad = eos[0] if eos else decoder.tokenizer.pad_token_id

    def run(ids: list[int], turn: int) -> TurnRecord:
        if len(ids) + max_new_tokens > decoder.target.max_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {decoder.target.max_length} tokens"
            )
        input_ids = torch.tensor([ids], device=decoder.target.device)
        counter = _RoundCounter()
        kwargs: dict = dict(
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=counter,
        )
        restore: dict = {}
        if mode == "pld":
            kwargs.update(prompt_lookup_num_tokens=draft_len, max_matching_ngram_size=max_ngram)
        elif mode == "assisted":
            config = assistant.generation_config
            wanted = {
                "num_assistant_tokens": draft_len,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            restore = {key: getattr(config, key, None) for key in wanted}
            for key, value in wanted.items():
                setattr(config, key, value)
            kwargs["assistant_model"] = assistant
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids, **kwargs)
            wall = time.perf_counter() - start
        finally:
            for key, value in restore.items():
                setattr(assistant.generation_config, key, value)
        tokens = out[0, len(ids) :].tolist()
        stop = next((i for i, t in enumerate(tokens) if t in decoder.target.eos_token_ids), None)
        finish = "stop" if stop is not None else "length"
        if sum(counter.sizes) != len(tokens):  # the streamer is how rounds are counted: never guess them
            raise RuntimeError(
                f"transformers streamed {sum(counter.sizes)} tokens but returned {len(tokens)}; cannot count its rounds"
            )
        return TurnRecord(list(ids), tokens, decoder.decode(tokens), wall, counter.sizes, None, finish)

    return run


class ScriptedPolicy(ArmStats):
    """Replays a hindsight plan: at each round, the (drafter, k) `script(position)` names for the current position
    (the request's `max_new_tokens` less the tokens it may still generate), drafting up to the plan's longest draft.
    The choice costs a list lookup, so the replay times the drafting and verification the oracle's choices cause,
    not the hindsight search.
    """

    def __init__(
        self, n_arms: int, script: Callable[[int], tuple[int | None, int]], max_draft: int, max_new_tokens: int
    ):
        self.script = script
        self.max_draft = max_draft
        self.max_new_tokens = max_new_tokens
        super().__init__(n_arms)

    def choose(self, k: int, proposals, lags, *, remaining: int | None = None, **_) -> tuple[int | None, int]:
        arm, planned = self.script(self.max_new_tokens - remaining)
        return (arm, min(planned, k)) if arm is not None and planned > 0 else (None, 0)


def oracle_turn(
    decoder, plans: Sequence[Sequence[tuple[int | None, int]]], max_draft: int, max_new_tokens: int, seed: int | None
) -> TurnRunner:
    """Replay `plans[turn][position]` (the hindsight plan's (drafter, k) at each position) through the engine."""
    names = decoder.drafter_names

    def run(ids: list[int], turn: int) -> TurnRecord:
        plan = plans[turn]
        script = lambda pos: plan[pos] if pos < len(plan) else (None, 0)  # noqa: E731
        scripted = lambda: ScriptedPolicy(len(names), script, max_draft, max_new_tokens)  # noqa: E731
        return engine_turn(decoder, scripted, max_new_tokens, seed)(ids, turn)

    return run
