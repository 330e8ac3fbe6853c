"""SGLang's native HTTP API on a tokenizer replica's HTTP port: protocol.py (the request models,
SGLang's names), convert.py (body → prompts and sampling requests, refusals by field name),
results.py (chunks → ``text`` / ``output_ids`` / ``meta_info``), info.py (model and server info),
routes.py (``/generate``, ``/get_model_info``, ``/server_info``, ``/flush_cache``, ``/abort_request``,
``/health_generate``, ``/open_session``, ``/close_session``, and the endpoints with no meaning here)."""

from services.tokenizer.http.native.routes import install

__all__ = ["install"]
