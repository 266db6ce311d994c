"""Helpers for tests and examples: tiny models built locally, no model hub."""
