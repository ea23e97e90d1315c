"""Chat requests from the later turns of recorded conversations: for each ShareGPT conversation of a JSONL file,
its second user turn with the exchange before it as context (the first request and the answer it got), as a
`messages` record a prompt file holds (`specialists/prompts.py` reads a chat that ends with the user's turn whole).

The target answers them in `metasd train-eagle --prompts`: answers to requests that follow a conversation, which the
first turns alone never show it. Conversations whose three turns hold more than `--max-chars` characters are left
out (the training skips prompts over `--max-prompt-tokens` anyway), and so are second requests under
`SHORTEST_REQUEST` characters ("go on", "thanks": answers to them lean on the conversation more than on a request).

Usage: python scripts/later_turn_prompts.py specialists/corpora/chat.jsonl eagle-data/prompts/second-turns.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from metasd.specialists.prompts import chat_message

SHORTEST_REQUEST = 20  # characters of a second request worth answering (as build_specialists.py keeps first turns)


def second_turns(lines: list[str], max_chars: int) -> list[list[dict]]:
    """Per conversation whose first three turns are a request, an answer and a request: those three."""
    out = []
    for line in lines:
        try:
            turns = json.loads(line).get("conversations")
            said = [chat_message(t) for t in turns[:3]]
        except (json.JSONDecodeError, AttributeError, TypeError, KeyError):
            continue  # not a conversation record
        if [m["role"] for m in said] != ["user", "assistant", "user"]:
            continue
        if not all(isinstance(m["content"], str) and m["content"].strip() for m in said):
            continue
        if len(said[2]["content"]) >= SHORTEST_REQUEST and sum(len(m["content"]) for m in said) <= max_chars:
            out.append(said)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("conversations", help="a JSONL file of ShareGPT conversations (never a benchmark set)")
    parser.add_argument("out", help="the prompt file to write")
    parser.add_argument("--max-chars", type=int, default=3000, help="context and request, at most (default: 3000)")
    args = parser.parse_args()
    lines = [line for line in Path(args.conversations).read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = second_turns(lines, args.max_chars)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts), encoding="utf-8")
    print(f"{len(prompts)} second turns of {len(lines)} conversations -> {args.out}")


if __name__ == "__main__":
    main()
