"""Tools over minispec's public API, apart from the engine (nothing in it imports them): the bench
(`python -m minispec.tools.bench`) and draft-head training (`python -m minispec.tools.train_heads`)."""
