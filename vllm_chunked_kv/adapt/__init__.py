"""`vllm-chunked-kv adapt`: fine-tune a model to read its own chunked KV cache (docs/adapt.md)."""
