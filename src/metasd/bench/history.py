"""Cross-request drafter state, kept identical for every method measured on a question.

Some drafters learn across requests (the suffix drafter indexes earlier outputs). Methods are interleaved per
question, so without care the second method on a question would find the first method's answer to that very
question in the index and draft it back almost perfectly. Instead, before each method runs on question i, the
drafters that say they learn across requests (`learns_across_requests`) are restored to one snapshot: "has served
the reference (`ar`) answers of questions 0..i-1". The others keep nothing from one request to the next and are left
alone (a datastore's memory maps are shared and read-only, and cannot be pickled).
"""

from __future__ import annotations

import pickle


class DrafterHistory:
    """A snapshot of the drafters that learn across requests: "has served the reference answers of the questions
    before this one", restored before each method runs on a question."""

    def __init__(self, drafters: dict):
        self.stateful = {name: d for name, d in drafters.items() if d.learns_across_requests}
        self._snapshot = self._capture()

    def _capture(self) -> dict[str, bytes]:
        return {name: pickle.dumps(d.__dict__, protocol=pickle.HIGHEST_PROTOCOL) for name, d in self.stateful.items()}

    def restore(self) -> None:
        """Put every model-free drafter back to the current snapshot."""
        for name, d in self.stateful.items():
            state = pickle.loads(self._snapshot[name])
            d.__dict__.clear()
            d.__dict__.update(state)

    def advance(self, turns: list[tuple[list[int], list[int]]]) -> None:
        """The snapshot plus one served request per (prompt ids, output ids): what the next question starts from."""
        self.restore()
        for prompt, output in turns:
            for d in self.stateful.values():
                d.begin(list(prompt))
                d.end(list(prompt) + list(output))
        self._snapshot = self._capture()
