"""Convert an HF GLM-5 / 5.1 / 5.2 checkpoint into a Megatron distributed checkpoint.

Usage:
    python conversion/hf_to_megatron.py HF_DIR OUT_DIR [--tp N] [--overwrite]

--tp N > 1 needs N processes: `torchrun --nproc-per-node N conversion/hf_to_megatron.py ... --tp N`.
CLI equivalent: `glm5-bridge convert HF_DIR OUT_DIR`. Library: `glm5_bridge.convert.hf_to_megatron`.
"""

from __future__ import annotations

import argparse
import sys

from glm5_bridge.cli import at_least, run_command, start_process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="HF GLM-5.x checkpoint → Megatron distributed checkpoint "
                                                 "(weights/, hf/, glm5_bridge.json). OUT_DIR appears only once "
                                                 "complete; the source is only read.")
    parser.add_argument("hf_path", help="HF checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="Megatron checkpoint folder to write (must not exist unless --overwrite)")
    parser.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel size of the Megatron side (default 1)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if glm5-bridge wrote it")
    parser.add_argument("--debug", action="store_true", help="show upstream warnings and tracebacks")
    args = parser.parse_args(argv)

    start_process(args.debug)

    def convert() -> None:
        from glm5_bridge.convert import hf_to_megatron

        overrides = {"tensor_model_parallel_size": args.tp, "sequence_parallel": True} if args.tp > 1 else {}
        out = hf_to_megatron(args.hf_path, args.out_dir, overwrite=args.overwrite, **overrides)
        print(f"Megatron distributed checkpoint written to {out}")

    return run_command(parser.prog, convert, args.debug)


if __name__ == "__main__":
    sys.exit(main())
