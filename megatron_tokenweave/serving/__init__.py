"""Serving a TokenWeave model with Megatron-Core's own inference stack: engines (static and
dynamic), an offline tokenizer, and the Flask text generation server for a TP group."""
