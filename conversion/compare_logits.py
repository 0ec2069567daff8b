"""Compare Megatron (our bridge) and transformers logits of an HF checkpoint on random tokens.

Usage:
    python conversion/compare_logits.py HF_DIR [--seq-len 64] [--batch 2] [--tol 1e-5]

Both models run in fp32 on the same random token ids; prints the max |difference| and exits 1 if
it is above --tol. CLI equivalent: `glm5-bridge parity HF_DIR`. Library: `glm5_bridge.parity.logits_parity`.
"""

from __future__ import annotations

import argparse
import sys

from glm5_bridge.cli import USER_ERRORS, one_line_error, start_process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Max |logits(Megatron) - logits(transformers)| of an HF GLM-5.x "
                                                 "checkpoint on random tokens (fp32). Exit 1 above --tol.")
    parser.add_argument("checkpoint", help="HF checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest accepted difference (default 1e-5)")
    args = parser.parse_args(argv)

    start_process()
    from glm5_bridge.parity import logits_parity

    try:
        diff = logits_parity(args.checkpoint, seq_len=args.seq_len, batch=args.batch)
    except USER_ERRORS as e:
        return one_line_error(parser.prog, e)
    verdict = "OK" if diff <= args.tol else "ABOVE TOLERANCE"
    print(f"max |logits(Megatron) - logits(transformers)| = {diff:.3e}  "
          f"(batch {args.batch}, seq_len {args.seq_len}, tol {args.tol:.0e}): {verdict}")
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
