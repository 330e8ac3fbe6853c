"""``banyan bench``: a serving benchmark for Banyan (gRPC) and any OpenAI-compatible server."""
