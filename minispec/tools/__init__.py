"""Tools over minispec's public API, apart from the inference engine: the bench (`python -m
minispec.tools.bench`) and draft-head training (`python -m minispec.tools.train_heads`). They import the
package's front door and the few modules tests/test_imports.py names for them; nothing in the engine
imports them."""
