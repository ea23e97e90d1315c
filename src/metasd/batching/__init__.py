"""Continuous batching: requests in flight share one target forward per round (`Batch`), with each request's
speculation chosen for the whole batch (`decide`)."""

# requests `metasd serve` decodes together by default (docs/serving.md: throughput by batch size on this project's
# CPUs)
DEFAULT_MAX_BATCH = 8
