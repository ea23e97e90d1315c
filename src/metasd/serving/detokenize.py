"""Text of a growing list of token ids, decoding a few tokens per step instead of the whole output every round.

The approach of Hugging Face TGI and vLLM: decode the window from a prefix offset twice, with and without the new
tokens, and take the difference; the prefix gives the tokenizer the context it needs for spaces and merges, and a
window that ends in an incomplete UTF-8 character (U+FFFD) waits for its next token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """Text of a growing token list, emitted as it becomes final (a token that may still merge with the next
    waits), as a stream needs it."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.text = ""
        self._prefix = 0  # window start: tokens before it are in self.text and need not be decoded again
        self._read = 0  # tokens whose text is in self.text

    def update(self, ids: Sequence[int]) -> str:
        """The text of ids (which extend the ids of the previous call), as far as it is complete."""
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
        return self.text

    def finish(self, ids: Sequence[int]) -> str:
        """The whole text, including an incomplete character the output ends with (it shows as U+FFFD)."""
        after = self._decode(ids[self._prefix :])
        before = self._decode(ids[self._prefix : self._read])
        self.text += after[len(before) :]
        self._prefix = self._read = len(ids)
        return self.text
