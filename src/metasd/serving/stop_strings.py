"""Stop strings in streamed text: where one begins, and how much of a partial text may go out without sending what
could still turn into one."""

from __future__ import annotations


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string begins, searching from start (the text before it was searched already)."""
    return min((i for s in stops if (i := text.find(s, start)) >= 0), default=None)


def _sendable(text: str, stops: list[str]) -> int:
    """How much of a partial text may be streamed: not a trailing incomplete character (it decodes to U+FFFD until
    its last byte arrives) nor a tail that could still grow into a stop string. O(len(stop)) per stop string: only
    the last len(stop) - 1 characters can start one."""
    end = len(text.rstrip("\ufffd"))
    held = max((_stop_prefix_at_end(text, end, s) for s in stops), default=0)
    return end - held


def _stop_prefix_at_end(text: str, end: int, stop: str) -> int:
    """The longest k < len(stop) with text[:end] ending in stop[:k] (Knuth-Morris-Pratt over the tail)."""
    if len(stop) < 2:
        return 0
    fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[:i + 1]
    for i in range(1, len(stop)):
        k = fail[i - 1]
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        fail[i] = k + (stop[i] == stop[k])
    k = 0
    for ch in text[max(0, end - len(stop) + 1) : end]:
        while k and ch != stop[k]:
            k = fail[k - 1]
        if ch == stop[k]:
            k += 1
        if k == len(stop):  # a whole stop string (_find_stop cuts those): keep only its longest border
            k = fail[k - 1]
    return k
