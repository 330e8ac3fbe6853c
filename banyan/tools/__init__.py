"""Operator tools behind `banyan check-env` and `banyan top`."""
