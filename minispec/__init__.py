"""minispec: a minimal, fast PyTorch engine for speculative decoding."""
