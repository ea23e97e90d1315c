"""Prompt files: JSONL records read as chat prompts, for `metasd distill` and `metasd train-eagle` (the target answers
them) in one set of formats: a string field (`prompt`, `question`, ...), Spec-Bench-like `turns` (the first), a
chat request's `messages` ending with the user's turn (whole: the conversation so far, earlier answers included, as
context), or a recorded conversation (`conversations`, ShareGPT's `from`/`value`, or `messages` ending with an
answer) up to its first answer; and a chat turn's role and content as every reader of chat records here (prompts,
datastores, EAGLE texts) maps them. ShareGPT's `conversations` are read up to their first answer even when they
end with a user's turn: a scraped conversation often stops there by accident."""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_FIELDS = ("prompt", "question", "instruction", "input", "text")
_ROLES = {"system": "system", "developer": "system"} | dict.fromkeys(
    ("assistant", "gpt", "chatgpt", "bing", "bard", "model"), "assistant"
)


def chat_turn(turn: dict) -> tuple[str, object]:
    """A turn's role as chat templates name them and its content, from OpenAI's `role`/`content` or ShareGPT's
    `from`/`value`: the system's (OpenAI's `developer` too), the answer's (ShareGPT's gpt, chatgpt, bing, bard;
    Gemini's model), and any other speaker's, `human` or none named, the user's."""
    speaker = str(turn.get("role", turn.get("from", "user"))).lower()
    return _ROLES.get(speaker, "user"), turn.get("content", turn.get("value"))


def chat_message(turn: dict) -> dict:
    """A turn as a chat template's message: {"role": ..., "content": ...} as `chat_turn` reads them."""
    role, content = chat_turn(turn)
    return {"role": role, "content": content}


def prompt_messages(record) -> list[dict] | None:
    """A JSONL record's prompt as chat messages: a string field, Spec-Bench-like `turns`, a chat request's
    `messages` (all of them when the last is the user's), or a conversation's turns before its first answer."""
    if isinstance(record, str):
        return [{"role": "user", "content": record}] if record.strip() else None
    if not isinstance(record, dict):
        return None
    for field in ("messages", "conversations"):
        turns = record.get(field)
        if isinstance(turns, list):
            if not all(isinstance(turn, dict) for turn in turns):
                return None
            said = [chat_message(turn) for turn in turns]
            request = field == "messages" and bool(said) and said[-1]["role"] == "user"
            if not request and any(m["role"] == "assistant" for m in said):  # the target writes the first answer
                said = said[: next(i for i, m in enumerate(said) if m["role"] == "assistant")]
            if not all(isinstance(m["content"], str) for m in said):
                return None
            return said if any(m["role"] == "user" and m["content"].strip() for m in said) else None
    if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
        return [{"role": "user", "content": record["turns"][0]}]
    for field in PROMPT_FIELDS:
        if isinstance(record.get(field), str) and record[field].strip():
            return [{"role": "user", "content": record[field]}]
    return None


def read_prompts(path: str | Path) -> list[list[dict]]:
    """The chat prompts of a JSONL file, one per non-blank line (`prompt_messages`); ValueError naming the line
    that has none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"cannot read --prompts: {err}") from err
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = prompt_messages(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from err
        if messages is None:
            raise ValueError(f'{path}:{number}: no prompt (expected "prompt", "turns", "messages", ... )')
        prompts.append(messages)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
