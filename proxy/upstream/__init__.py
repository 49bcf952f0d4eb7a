"""OpenAI-compatible upstreams over a shared, pooled HTTP client."""
