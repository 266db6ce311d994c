"""The demo: a tiny retrieval model trained on CPU, its tokenizer, training, evaluation and command."""
