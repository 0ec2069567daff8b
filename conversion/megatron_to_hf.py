"""Convert a Megatron distributed checkpoint written by hf_to_megatron.py back into an HF checkpoint.

Usage:
    python conversion/megatron_to_hf.py MEGATRON_DIR OUT_DIR [--overwrite]

CLI equivalent: `glm5-bridge convert MEGATRON_DIR OUT_DIR`. Library: `glm5_bridge.convert.megatron_to_hf`.
"""

from __future__ import annotations

import argparse
import sys

from glm5_bridge.cli import run_command, start_process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Megatron distributed checkpoint (written by hf_to_megatron.py "
                                                 "or `glm5-bridge convert`) → HF checkpoint (config, tokenizer, "
                                                 "safetensors). OUT_DIR appears only once complete.")
    parser.add_argument("megatron_dir", help="folder holding weights/, hf/ and glm5_bridge.json")
    parser.add_argument("out_dir", help="HF checkpoint folder to write (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if glm5-bridge wrote it")
    parser.add_argument("--debug", action="store_true", help="show upstream warnings and tracebacks")
    args = parser.parse_args(argv)

    start_process(args.debug)

    def convert() -> None:
        from glm5_bridge.convert import megatron_to_hf

        out = megatron_to_hf(args.megatron_dir, args.out_dir, overwrite=args.overwrite)
        print(f"HF checkpoint written to {out}")

    return run_command(parser.prog, convert, args.debug)


if __name__ == "__main__":
    sys.exit(main())
