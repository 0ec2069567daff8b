"""`glm5-bridge` command line. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _convert(args):
    from glm5_bridge.convert import MARKER, hf_to_megatron, megatron_to_hf

    src = Path(args.src)
    if (src / MARKER).is_file():
        out = megatron_to_hf(src, args.dst, overwrite=args.overwrite)
        print(f"HF checkpoint written to {out}")
    else:
        overrides = {"tensor_model_parallel_size": args.tp, "sequence_parallel": args.tp > 1} if args.tp > 1 else {}
        out = hf_to_megatron(src, args.dst, overwrite=args.overwrite, **overrides)
        print(f"Megatron distributed checkpoint written to {out}")


def _parity(args):
    from glm5_bridge.parity import logits_parity

    diff = logits_parity(args.checkpoint, seq_len=args.seq_len, batch=args.batch)
    print(f"max |logits(Megatron) - logits(transformers)| = {diff:.3e}  (seq_len {args.seq_len})")
    return 0 if diff <= args.tol else 1


def _make_tiny(args):
    from glm5_bridge.testing import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.variant, args.dst, seed=args.seed))


def _demo(args):
    from glm5_bridge.demo import run

    return run(args.workdir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5-bridge", description="GLM-5 / 5.1 / 5.2 with Megatron.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="HF checkpoint → Megatron distributed checkpoint, or back",
                       description="Convert an HF GLM-5.x checkpoint folder into a Megatron distributed "
                                   "checkpoint, or (when SRC was written by this command) back into HF format. "
                                   "The source is only read; DST appears only once complete.")
    p.add_argument("src", help="HF checkpoint folder, or a Megatron checkpoint written by this command")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron side (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(fn=_convert)

    p = sub.add_parser("parity", help="compare Megatron logits with transformers on a checkpoint",
                       description="Load CKPT in Megatron (our bridge) and in transformers, run the same random "
                                   "tokens through both in fp32 and print the max abs logit difference. Exit 1 if "
                                   "it is above --tol.")
    p.add_argument("checkpoint")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-5)
    p.set_defaults(fn=_parity)

    p = sub.add_parser("make-tiny", help="write a tiny random GLM-5.x HF checkpoint (for tests and demos)")
    p.add_argument("variant", choices=["GLM-5", "GLM-5.1", "GLM-5.2"])
    p.add_argument("dst")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_make_tiny)

    p = sub.add_parser("demo", help="the main job on the embedded default (tiny GLM-5.2), end to end",
                       description="Make a tiny GLM-5.2, convert it to Megatron, run it, export it back to HF "
                                   "and verify parity with transformers. Everything is written under WORKDIR.")
    p.add_argument("--workdir", default="runs/demo")
    p.set_defaults(fn=_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import glm5_bridge  # noqa: F401  (registers the bridge; after argparse so --help is instant)

    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
