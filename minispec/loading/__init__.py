"""Loading: checkpoint folders (checkpoint.py, weights.py), the hub, GGUF files, the built-in model,
tokenizers and chat templates, turned into the models of minispec.models."""
