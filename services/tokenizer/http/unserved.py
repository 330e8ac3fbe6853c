"""What a request for an endpoint Banyan does not serve gets: OpenAI's other endpoints (embeddings,
audio, images …) a 501 that names them, any other path a 404 that lists what is served."""

from __future__ import annotations

SERVED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/sessions", "/tokenize",
          "/detokenize", "/tokenizer_info", "/health", "/metrics", "/docs")
# OpenAI's (and vLLM's) endpoints that a causal LM server could be asked for, by path prefix
NOT_IMPLEMENTED = {
    "/v1/embeddings": "embeddings",
    "/v1/audio": "audio (speech, transcriptions, translations)",
    "/v1/images": "images",
    "/v1/moderations": "moderations",
    "/v1/files": "files",
    "/v1/uploads": "uploads",
    "/v1/batches": "batches",
    "/v1/fine_tuning": "fine-tuning",
    "/v1/assistants": "assistants",
    "/v1/threads": "threads",
    "/v1/vector_stores": "vector stores",
    "/v1/realtime": "realtime",
    "/v1/conversations": "conversations",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
    "/pooling": "pooling",
    "/classify": "classification",
}


def unserved(method: str, path: str) -> tuple[int, str, str]:
    """(HTTP status, message, error code) for a path no route serves."""
    for prefix, what in NOT_IMPLEMENTED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return 501, (f"{method} {path}: this server does not serve the {what} API ({prefix}); it serves a "
                         "text-generation model: " + ", ".join(SERVED[:4])), "not_implemented"
    return 404, f"{method} {path}: no such endpoint; this server serves " + ", ".join(SERVED), "not_found"
