"""Convert a llama.cpp GGUF file into a checkpoint directory once, ahead of loading (minispec.load
converts on first use too):

    python -m minispec.convert model.Q8_0.gguf ./model-dir [--keep-quantized] [--dtype bfloat16]
"""

import argparse

from .loading.checkpoint import check_checkpoint
from .loading.gguf import convert_gguf
from .loading.weights import DTYPES


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minispec.convert", description="Convert a llama.cpp GGUF file into a minispec checkpoint directory.")
    parser.add_argument("gguf", help="path of the .gguf file")
    parser.add_argument("out_dir", help="checkpoint directory to create")
    parser.add_argument("--dtype", choices=DTYPES, help="cast all (float) weights (default: keep)")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep quantized tensors quantized (int8/int4 with scales) instead of dequantizing them")
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out_dir, dtype=DTYPES.get(args.dtype), keep_quantized=args.keep_quantized,
                           check=check_checkpoint)
    except (ValueError, OSError) as error:  # a problem with the input or the output folder, not a bug
        parser.exit(2, f"error: {error}\n")
    print(out)


if __name__ == "__main__":
    main()
