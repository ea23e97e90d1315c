"""Chat messages as the token ids a model is prompted with: the tokenizer's chat template with the generation prompt
(what transformers' `generate` users feed), or, for a tokenizer without a template (a base model), the messages'
contents joined by newlines."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's ids: the template's text tokenized without adding special tokens again (the template has them)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
