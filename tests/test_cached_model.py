"""CachedModel: a KV cache that always holds exactly the tokens it was last asked about, whatever the caller does."""

import pytest
import torch
from helpers import tiny_llama

from metasd.cached_model import CachedModel
from metasd.tokens import common_prefix


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_llama(32, layers=2, positions=128)


def reference(model, tokens, last=1):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -last:].float()


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3, 4, 5], [1, 2, 9, 4, 5]) == 2
    assert common_prefix(list(range(1000)), [*range(700), -1]) == 700


def test_feeds_only_what_is_new_and_crops_what_diverged(tiny):
    lm = CachedModel(tiny)
    first = lm.logits_for([1, 2, 3, 4])
    assert lm.fed_tokens == 4 and lm.cache.get_seq_length() == 4
    assert torch.allclose(first, reference(tiny, [1, 2, 3, 4]), atol=1e-5)
    extended = lm.logits_for([1, 2, 3, 4, 5, 6], last=2)
    assert lm.fed_tokens == 6  # two new tokens only
    assert torch.allclose(extended, reference(tiny, [1, 2, 3, 4, 5, 6], last=2), atol=1e-5)
    diverged = lm.logits_for([1, 2, 9, 10])  # a rejected draft: the cache is cropped to [1, 2], then fed 9, 10
    assert lm.fed_tokens == 8 and lm.tokens == [1, 2, 9, 10] and lm.cache.get_seq_length() == 4
    assert torch.allclose(diverged, reference(tiny, [1, 2, 9, 10]), atol=1e-5)


def test_asking_again_for_the_same_tokens_refeeds_the_rows_it_must_return(tiny):
    lm = CachedModel(tiny)
    lm.logits_for([1, 2, 3])
    again = lm.logits_for([1, 2, 3], last=2)
    assert lm.fed_tokens == 5 and lm.cache.get_seq_length() == 3
    assert torch.allclose(again, reference(tiny, [1, 2, 3], last=2), atol=1e-5)


def test_reset_and_bad_requests(tiny):
    lm = CachedModel(tiny)
    lm.logits_for([1, 2])
    lm.reset()
    assert lm.tokens == [] and lm.fed_tokens == 0 and lm.cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="last"):
        lm.logits_for([1, 2], last=3)


def test_logits_fit_the_targets_vocabulary(tiny):
    wider = CachedModel(tiny, vocab_size=40)
    logits = wider.logits_for([1, 2])
    assert logits.shape == (1, 40) and torch.isinf(logits[0, 32:]).all()
    narrower = CachedModel(tiny, vocab_size=20)
    assert narrower.logits_for([1, 2]).shape == (1, 20)
