"""Attention backends over one paged KV layout (slot-indexed K/V per layer)."""
