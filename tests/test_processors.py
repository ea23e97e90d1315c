"""The target's own logits processors (metasd.processors): each verified row gets the prefix it predicts after."""

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from metasd.drafters.base import Draft
from metasd.processors import process, target_processors
from metasd.tree import DraftTree


def test_each_row_is_processed_with_the_context_and_the_path_before_it():
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    logits = torch.full((3, 8), 4.0)
    out = process(processors, logits, [1, 2], [[], [3], [3, 4]])  # a chain: row j after context + draft[:j]
    penalised = [{1, 2}, {1, 2, 3}, {1, 2, 3, 4}]
    assert [{i for i in range(8) if row[i] == 2.0} for row in out] == penalised
    assert torch.equal(logits, torch.full((3, 8), 4.0))  # the forward's logits are left as they were
    tree = DraftTree.chain(Draft([3, 4]))
    tree.add(1, Draft([5]))  # a sibling of 3: its row sees the context and 5 only
    out = process(processors, torch.full((4, 8), 4.0), [1, 2], tree.prefixes())
    assert [{i for i in range(8) if row[i] == 2.0} for row in out] == [*penalised, {1, 2, 5}]


def test_a_plain_generation_config_has_no_processors(embedded):
    """The embedded target's config sets none: its rounds skip processing altogether."""
    assert target_processors(embedded.model, 20, 8) is None
