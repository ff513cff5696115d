"""Placeholder: being written."""


def load_tokenizer(directory):
    return None
