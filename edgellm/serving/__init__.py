"""The HTTP server's parts that stand apart from its endpoints: OpenAI-shaped errors, the request guard (API key,
Host and Content-Type checks, CORS, the loading gate), per-request limits and Prometheus metrics."""
