"""The target's own logits processors (metasd.processors): each verified row gets the prefix it predicts after."""

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from metasd.processors import process, target_processors


def test_each_row_is_processed_with_the_context_and_the_draft_before_it():
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    logits = torch.full((3, 8), 4.0)
    out = process(processors, logits, [1, 2], [3, 4])
    penalised = [{1, 2}, {1, 2, 3}, {1, 2, 3, 4}]  # row j predicts the token after context + draft[:j]
    assert [{i for i in range(8) if row[i] == 2.0} for row in out] == penalised
    assert torch.equal(logits, torch.full((3, 8), 4.0))  # the forward's logits are left as they were


def test_a_plain_generation_config_has_no_processors(embedded):
    """The embedded target's config sets none: its rounds skip processing altogether."""
    assert target_processors(embedded.model, 20, 8) is None
