"""Handwritten model families; each file: config -> layers -> model -> checkpoint key mapping."""
