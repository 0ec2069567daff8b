"""Compare Megatron (our bridge) and transformers logits of an HF checkpoint on random tokens.

Usage:
    python conversion/compare_logits.py HF_DIR [--seq-len 64] [--batch 2] [--tol 1e-5]

Both models run in fp32 on the same random token ids; prints the max |difference| and exits 1 if
it is above --tol. CLI equivalent: `glm5-bridge parity HF_DIR`. Library: `glm5_bridge.parity.logits_parity`.
"""

from __future__ import annotations

import argparse
import sys

from glm5_bridge.cli import at_least, run_command, start_process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Max |logits(Megatron) - logits(transformers)| of an HF GLM-5.x "
                                                 "checkpoint on random tokens (fp32). Exit 1 above --tol.")
    parser.add_argument("checkpoint", help="HF checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("--seq-len", type=at_least(1), default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=at_least(1), default=2, help="sequences (default 2)")
    parser.add_argument("--tol", type=at_least(0.0, float), default=1e-5, help="largest accepted difference (default 1e-5)")
    parser.add_argument("--debug", action="store_true", help="show upstream warnings and tracebacks")
    args = parser.parse_args(argv)

    start_process(args.debug)

    def compare() -> int:
        from glm5_bridge.parity import logits_parity

        diff = logits_parity(args.checkpoint, seq_len=args.seq_len, batch=args.batch)
        verdict = "OK" if diff <= args.tol else "ABOVE TOLERANCE"
        print(f"max |logits(Megatron) - logits(transformers)| = {diff:.3e}  "
              f"(batch {args.batch}, seq_len {args.seq_len}, tol {args.tol:.0e}): {verdict}")
        return 0 if diff <= args.tol else 1

    return run_command(parser.prog, compare, args.debug)


if __name__ == "__main__":
    sys.exit(main())
