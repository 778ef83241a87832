"""Ponytail as a Ray Serve application: engine replicas, a KV-aware router, an OpenAI-compatible API."""
