"""Continuous batching: requests in flight share one target forward per round (`Batch`), with each request's
speculation chosen for the whole batch (`decide`)."""

# requests `metasd serve` decodes together by default (docs/serving.md: throughput by batch size on this project's
# CPUs)
DEFAULT_MAX_BATCH = 8

# the share of a round's time a joining prompt gets while others decode (`batch.Batch`; docs/batching.md)
DEFAULT_PREFILL_SHARE = 0.5
