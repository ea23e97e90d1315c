"""Serving: the OpenAI-compatible HTTP server, Ray Serve replicas and incremental detokenization."""
