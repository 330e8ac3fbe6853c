"""Typed internal wire messages, one module per destination, one codec (no pickle anywhere).

- ``to_scheduler``: what tokenizers and worker rank 0 send to the scheduler.
- ``to_tokenizer``: what the scheduler sends to a tokenizer replica.
- ``to_worker``: what the scheduler sends to worker rank 0 (new requests once, then diffs).
"""
