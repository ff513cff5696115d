"""Placeholder: being written."""
from .base import CachedLM


class LlamaConfig:
    @classmethod
    def from_hf(cls, hf):
        raise NotImplementedError


class Llama(CachedLM):
    pass


def convert_hf_weights(weights, config):
    raise NotImplementedError
