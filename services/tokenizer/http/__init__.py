"""The OpenAI-compatible HTTP front of a tokenizer replica (FastAPI, served by uvicorn in the
tokenizer's event loop beside gRPC): app.py routes, protocol.py request/response models,
convert.py OpenAI ↔ internal types, errors.py OpenAI-shaped errors, middleware.py API key +
limits + metrics, streams.py merge / disconnect helpers, server.py the uvicorn task."""
