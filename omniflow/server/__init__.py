"""The OpenAI-compatible HTTP server that `omniflow run` starts."""
