"""Chat prompts as ids: the template with the generation prompt, or the contents joined for a template-less
tokenizer; the decoder and the training corpora prompt alike."""

import copy

from metasd.models.chat import chat_prompt_ids

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_a_template_prompts_as_transformers_users_do(embedded):
    tokenizer = embedded.tokenizer
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = chat_prompt_ids(tokenizer, CHAT)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # the generation prompt, once


def test_without_a_template_the_contents_are_joined(embedded):
    tokenizer = copy.deepcopy(embedded.tokenizer)
    tokenizer.chat_template = None
    assert chat_prompt_ids(tokenizer, CHAT) == tokenizer("Be brief.\nName a colour.")["input_ids"]
