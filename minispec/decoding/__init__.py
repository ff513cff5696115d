"""Decoding: the engine and Algorithm 1's step (engine.py, speculative.py), what proposes the guesses
(drafters.py) and how many (policy.py), sampling and stopping, and speculative beam search (beam.py)."""
