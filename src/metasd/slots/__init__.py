"""Rows of preallocated KV slots over one model: a forward for many sequences at once, each at its own positions
(`rows.BatchedTarget`), padded (`rows`) or packed (`ragged`). The batch's target cache, and where forks of a model
drafter draft together."""

from .rows import BatchedTarget, Row, check_batched_logits

__all__ = ["BatchedTarget", "Row", "check_batched_logits"]
