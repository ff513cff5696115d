"""Checkpoint files: minispec's own safetensors writer, read back by the safetensors package."""

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file

from minispec.loading.weights import (SAFETENSORS_DTYPES, CheckpointError, read_dtypes, read_weights,
                                      save_safetensors)


def sample_tensors():
    generator = torch.Generator().manual_seed(0)
    tensors = {f"t.{dtype}".replace("torch.", ""): (torch.randn(3, 5, generator=generator) * 50).to(dtype)
               for dtype in SAFETENSORS_DTYPES}
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["odd_length"] = torch.arange(7, dtype=torch.uint8)  # leaves the next tensor unaligned
    tensors["strided"] = torch.arange(12.0).view(3, 4).t()  # written as its contiguous copy
    tensors["offset_view"] = torch.arange(10, dtype=torch.int16)[3:8]
    return tensors


def test_written_files_read_back_exactly(tmp_path):
    tensors = sample_tensors()
    save_safetensors(tensors, tmp_path / "w.safetensors", metadata={"format": "pt"})
    loaded = load_file(tmp_path / "w.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_an_unsupported_dtype_is_named(tmp_path):
    with pytest.raises(ValueError, match="complex"):
        save_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")


def test_dtypes_come_from_the_headers(tmp_path):
    save_safetensors({"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.int32)}, tmp_path / "1.safetensors")
    save_safetensors({"c": torch.ones(1, dtype=torch.bfloat16)}, tmp_path / "2.safetensors")
    assert read_dtypes([tmp_path / "1.safetensors", tmp_path / "2.safetensors"]) == {"a": "F32", "b": "I32", "c": "BF16"}


def with_header(header, data):
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


GOOD_HEADER = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
MALFORMED = {
    "empty": b"",
    "shorter than its length field": b"\x10\x00\x00",
    "data truncated": with_header(GOOD_HEADER, bytes(10)),
    "header length past the end": struct.pack("<Q", 10**6) + b"{}",
    "header length 2^64 - 1": struct.pack("<Q", 2**64 - 1) + b"{}",
    "header not JSON": struct.pack("<Q", 8) + b"notjson!",
    "header a list": with_header([1, 2], b""),
    "offsets past the data": with_header({"w": {**GOOD_HEADER["w"], "data_offsets": [0, 10**9]}}, bytes(16)),
    "negative shape": with_header({"w": {**GOOD_HEADER["w"], "shape": [-2, 2]}}, bytes(16)),
    "shape overflowing": with_header({"w": {**GOOD_HEADER["w"], "shape": [2**63, 2]}}, bytes(16)),
    "unknown dtype": with_header({"w": {**GOOD_HEADER["w"], "dtype": "F7"}}, bytes(16)),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_file_is_one_error_naming_it(tmp_path, case):
    file = tmp_path / "model.safetensors"
    file.write_bytes(MALFORMED[case])
    for read in (read_dtypes, read_weights):
        with pytest.raises(CheckpointError, match=re.escape(f"cannot read weights from {file}: ")) as error:
            read([file])
        assert "\n" not in str(error.value)
