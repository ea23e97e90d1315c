"""EAGLE heads that learn from the traffic they draft for: a bounded buffer of verified sequences per history key
(`buffer.py`) and a low-priority background trainer that swaps a fine-tuned copy in only when it measures better
on recent held-out requests (`learner.py`). docs/learning.md says how to run it and what it keeps."""

from .buffer import TrafficBuffer
from .learner import HeadLearner, LearningConfig, learn_heads

__all__ = ["HeadLearner", "LearningConfig", "TrafficBuffer", "learn_heads"]
