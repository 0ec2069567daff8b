"""Convert a Megatron distributed checkpoint written by hf_to_megatron.py back into an HF checkpoint.

Usage:
    python conversion/megatron_to_hf.py MEGATRON_DIR OUT_DIR [--overwrite]

CLI equivalent: `glm5-bridge convert MEGATRON_DIR OUT_DIR`. Library: `glm5_bridge.convert.megatron_to_hf`.
"""

from __future__ import annotations

import argparse
import sys

from glm5_bridge.cli import USER_ERRORS, one_line_error, start_process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Megatron distributed checkpoint (written by hf_to_megatron.py "
                                                 "or `glm5-bridge convert`) → HF checkpoint (config, tokenizer, "
                                                 "safetensors). OUT_DIR appears only once complete.")
    parser.add_argument("megatron_dir", help="folder holding weights/, hf/ and glm5_bridge.json")
    parser.add_argument("out_dir", help="HF checkpoint folder to write (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)

    start_process()
    from glm5_bridge.convert import megatron_to_hf

    try:
        out = megatron_to_hf(args.megatron_dir, args.out_dir, overwrite=args.overwrite)
    except USER_ERRORS as e:
        return one_line_error(parser.prog, e)
    print(f"HF checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
