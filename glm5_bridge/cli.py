"""`glm5-bridge` command line. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
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
    from glm5_bridge.parity import logits_parity, logprob_parity

    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
        result = logprob_parity(args.checkpoint, lengths, dtype=args.dtype, backend=args.backend, run=args.run,
                                hf=args.hf, adapter=args.adapter)
        for key in ("megatron_vs_hf_fp32", "megatron_vs_hf_same_dtype", "floor_hf_bf16_vs_fp32"):
            s = result[key]
            print(f"{key:28s} |Δ log p| max {s['max']:.3e}  p99 {s['p99']:.3e}  median {s['median']:.3e}")
        ratio = result["max_over_floor_max"]
        print(f"{result['tokens']} tokens in {len(lengths)} packed sequences, {args.dtype}, {args.backend}; "
              f"max / floor max = {ratio:.2f}" if ratio is not None else "floor is 0")
        if args.json:
            from glm5_bridge.files import atomic_write_text

            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
        return 0 if ratio is None or ratio <= args.floor_ratio else 1
    diff = logits_parity(args.checkpoint, seq_len=args.seq_len, batch=args.batch)
    print(f"max |logits(Megatron) - logits(transformers)| = {diff:.3e}  (seq_len {args.seq_len})")
    return 0 if diff <= args.tol else 1


def _make_tiny(args):
    from glm5_bridge.tiny import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.variant, args.dst, seed=args.seed, overwrite=args.overwrite))


def _make_slice(args):
    from glm5_bridge.slice import make_slice_checkpoint

    print(make_slice_checkpoint(args.variant, args.dst, layers=args.layers, experts=args.experts, seed=args.seed,
                                overwrite=args.overwrite))


def _train(args):
    from glm5_bridge.train.recipe import find_recipe, load_recipe

    recipe = load_recipe(find_recipe(args.recipe), args.overrides)
    out = Path(recipe.train.output_dir)
    fresh = not out.exists()
    try:
        _run_recipe(recipe, out)
    except BaseException:
        # A run that fails before its first checkpoint (bad data, bad checkpoint, ...) leaves nothing.
        if fresh and not (out / "checkpoints" / "latest").exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run_recipe(recipe, out: Path):
    if recipe.task == "sft":
        from glm5_bridge.train.sft import train_sft

        result = train_sft(recipe)
        print(f"final loss {result['history'][-1]['loss']:.4f}; curve {result.get('loss_curve')}; "
              f"export {result.get('export', 'none')}")
    elif recipe.rl.colocated:
        from glm5_bridge.train.colocated import colocated_rl

        colocated_rl(recipe)
    else:
        from glm5_bridge.train.rl import train_rl

        train_rl(recipe)


def _export(args):
    from glm5_bridge.train import checkpoint
    from glm5_bridge.train.engine import Engine
    from glm5_bridge.files import check_output
    from glm5_bridge.train.export import export_adapter, export_merged
    from glm5_bridge.train.recipe import load_recipe

    run = Path(args.run)
    check_output(args.dst, [run], args.overwrite)  # before the (long) model build
    recipe = load_recipe(run / "recipe.yaml")
    check_output(args.dst, [run, recipe.model.checkpoint], args.overwrite)
    saved = checkpoint.latest(run / "checkpoints")
    if saved is None:
        raise FileNotFoundError(f"{run}/checkpoints: no checkpoint to export")
    engine = Engine(recipe)
    _, history = checkpoint.load(saved, engine)
    write = export_adapter if args.kind == "adapter" else export_merged
    out = write(engine.bridge, engine.chunk, args.dst, overwrite=args.overwrite, show_progress=True, reads=[run],
                recipe=recipe, history=history)
    print(f"{args.kind} export written to {out}")


def _plan(args):
    from glm5_bridge.model.config import load_hf_config
    from glm5_bridge.train.plan import GPU_MEMORY_GIB, Plan, count_parameters, longest_sequence, memory_per_gpu, verdict

    c = load_hf_config(args.model)
    counts = count_parameters(c)
    print("parameters: " + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in counts.items()))
    stages = tuple(int(x) for x in args.stages.split(",")) if args.stages else None
    plan = Plan(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, seq_len=args.seq_len, lora_dim=args.lora_dim,
                stage_layers=stages)
    m = memory_per_gpu(c, plan)
    print(f"busiest GPU (PP stage {m['stage']}) at TP={args.tp} PP={args.pp} EP={args.ep} CP={args.cp}, "
          f"{args.seq_len} tokens, LoRA r={args.lora_dim}:")
    for key in ("weights_bf16", "lora_params_grads_adam", "activations", "total"):
        print(f"  {key:24s} {m[key]:8.2f} GiB")
    gib = args.gpu_memory_gib or (GPU_MEMORY_GIB[args.gpu] if args.gpu else 0)
    if gib:
        fits, line = verdict(c, plan, gib)
        print(f"{args.gpu or 'GPU'}: {line}")
        print(f"longest micro-batch this layout fits: {longest_sequence(c, plan, gib):,} tokens")
        return 0 if fits else 1


def _demo(args):
    from glm5_bridge.demo import run

    return run(args.workdir, sft_steps=args.sft_steps)


def at_least(low, kind=int):
    """An argparse type: a number of `kind` >= `low` (argparse then reports a bad value in one line)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text} is below {low}")
        return value

    parse.__name__ = kind.__name__
    return parse


class _OneLineParser(argparse.ArgumentParser):
    """argparse without the usage block before its error: one stderr line like every other error
    (`--help` still shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from glm5_bridge import __version__

    parser = _OneLineParser(prog="glm5-bridge", description="GLM-5 / 5.1 / 5.2 with Megatron.")
    parser.add_argument("--version", action="version", version=f"glm5-bridge {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show upstream warnings and logs, and a traceback instead of the one-line error")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_DefaultsShown)

    p = sub.add_parser("convert", help="HF checkpoint → Megatron distributed checkpoint, or back",
                       description="Convert an HF GLM-5.x checkpoint folder into a Megatron distributed "
                                   "checkpoint, or (when SRC was written by this command) back into HF format. "
                                   "The source is only read; DST appears only once complete.")
    p.add_argument("src", help="HF checkpoint folder, or a Megatron checkpoint written by this command")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel size of the Megatron side")
    p.add_argument("--overwrite", action="store_true", help="replace DST if glm5-bridge wrote it")
    p.set_defaults(fn=_convert)

    p = sub.add_parser("parity", help="compare Megatron logits with transformers on a checkpoint",
                       description="Load CKPT in Megatron (our bridge) and in transformers, run the same random "
                                   "tokens through both in fp32 and print the max abs logit difference. Exit 1 if "
                                   "it is above --tol.")
    p.add_argument("checkpoint", help="HF checkpoint folder")
    p.add_argument("--seq-len", type=at_least(1), default=64, help="tokens per sequence")
    p.add_argument("--batch", type=at_least(1), default=2, help="sequences")
    p.add_argument("--tol", type=at_least(0.0, float), default=1e-5, help="largest acceptable max |logit difference|")
    g = p.add_argument_group("next-token log-probs on packed sequences (--lengths): Megatron in --dtype against "
                             "transformers in fp32, next to the floor: transformers bf16 vs fp32")
    g.add_argument("--lengths", help="comma-separated sequence lengths packed into one micro-batch, e.g. 4608,3584")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="Megatron's compute dtype")
    g.add_argument("--backend", choices=["megatron", "tilelang"], default="megatron", help="DSA attention backend")
    g.add_argument("--run", help="Megatron side: a training run folder (latest checkpoint, adapters on)")
    g.add_argument("--hf", help="transformers side: this HF folder instead of CHECKPOINT (e.g. a merged export)")
    g.add_argument("--adapter", help="transformers side: a PEFT adapter folder on top")
    g.add_argument("--json", help="write the numbers here")
    g.add_argument("--floor-ratio", type=at_least(0.0, float), default=2.0,
                   help="exit 1 if max |Δ log p| exceeds this multiple of the floor's max")
    p.set_defaults(fn=_parity)

    p = sub.add_parser("train", help="run a YAML recipe (LoRA SFT or LoRA RL)",
                       description="Train with a recipe (a file, or a shipped one by name). Dotted overrides follow the file, e.g. "
                                   "`glm5-bridge train recipes/tiny_lora_sft.yaml train.steps=20 lora.dim=8`; an "
                                   "unknown key or a wrong type is an error naming the key. A run resumes from "
                                   "its last checkpoint in train.output_dir.")
    p.add_argument("recipe", help="a recipe file (YAML), or the name of a shipped one (tiny_lora_sft, "
                                   "glm52_lora_sft, …: glm5_bridge/recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value, dotted (train.steps=20)")
    p.set_defaults(fn=_train)

    p = sub.add_parser("export", help="export a trained run to HF: merged weights or a PEFT adapter",
                       description="Rebuild the run's model from RUN/recipe.yaml, load its last checkpoint and write "
                                   "either an HF checkpoint with the LoRA deltas merged (--kind merged) or an HF "
                                   "PEFT adapter (--kind adapter), the kinds a recipe's export.kind names. DST "
                                   "appears only once complete; the base checkpoint is only read.")
    p.add_argument("run", help="a training output_dir (holds recipe.yaml and checkpoints/)")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--kind", choices=["merged", "adapter"], help="merged: HF checkpoint with LoRA folded in; "
                      "adapter: HF PEFT adapter (adapter_config.json + safetensors)")
    kind.add_argument("--merge", dest="kind", action="store_const", const="merged", help="same as --kind merged")
    kind.add_argument("--adapter", dest="kind", action="store_const", const="adapter", help="same as --kind adapter")
    p.add_argument("--overwrite", action="store_true", help="replace DST if glm5-bridge wrote it")
    p.set_defaults(fn=_export)

    p = sub.add_parser("plan", help="parameters and per-GPU memory of a GLM-5.x model for a parallel layout",
                       description="Count parameters from config.json (a preset or a checkpoint folder) and estimate "
                                   "memory on the busiest GPU for LoRA training (bf16 frozen weights, fp32 adapters "
                                   "with Adam, activations with full recompute; see glm5_bridge/train/plan.py). Refuses "
                                   "pipeline splits where a stage would start on an IndexShare 'shared' layer.")
    p.add_argument("model", help='"GLM-5", "GLM-5.1", "GLM-5.2" or a checkpoint folder')
    for flag, default, what in (("--tp", 8, "tensor"), ("--pp", 1, "pipeline"), ("--ep", 8, "expert"),
                                ("--cp", 1, "context")):
        p.add_argument(flag, type=at_least(1), default=default, help=f"{what}-parallel size")
    p.add_argument("--seq-len", type=at_least(1), default=16384, help="tokens per micro-batch")
    p.add_argument("--lora-dim", type=at_least(0), default=64, help="LoRA rank")
    p.add_argument("--stages", help="decoder layers per PP stage, comma separated (default: even split)")
    p.add_argument("--gpu", choices=["H100", "H200", "A100", "B200"],
                   help="give a fits / does-not-fit verdict for this GPU (exit status 1 when it does not fit)")
    p.add_argument("--gpu-memory-gib", type=at_least(0.0, float), default=0.0, help="the same for a GPU of this much memory")
    p.set_defaults(fn=_plan)

    p = sub.add_parser("make-tiny", help="write a tiny random GLM-5.x HF checkpoint (for tests and demos)")
    p.add_argument("variant", choices=["GLM-5", "GLM-5.1", "GLM-5.2"], help="whose config (and IndexShare) to copy")
    p.add_argument("dst", help="output folder (new or empty unless --overwrite)")
    p.add_argument("--seed", type=at_least(0), default=0, help="random weights' seed")
    p.add_argument("--overwrite", action="store_true", help="replace DST if glm5-bridge wrote it")
    p.set_defaults(fn=_make_tiny)

    p = sub.add_parser("make-slice", help="write a random GLM-5.x HF checkpoint at real width with fewer layers",
                       description="The preset's exact config (real widths, vocab, IndexShare schedule, MTP layer) "
                                   "with the first LAYERS decoder layers and optionally fewer routed experts; bf16 "
                                   "shards with an index, weights at a trained model's scale (glm5_bridge/slice.py).")
    p.add_argument("variant", choices=["GLM-5", "GLM-5.1", "GLM-5.2"], help="whose config to copy")
    p.add_argument("dst", help="output folder (new or empty unless --overwrite)")
    p.add_argument("--layers", type=at_least(1), required=True, help="decoder layers (the first N of the schedule)")
    p.add_argument("--experts", type=at_least(1), default=None, help="routed experts per MoE layer (default: the preset's)")
    p.add_argument("--seed", type=at_least(0), default=0, help="random weights' seed")
    p.add_argument("--overwrite", action="store_true", help="replace DST if glm5-bridge wrote it")
    p.set_defaults(fn=_make_slice)

    p = sub.add_parser("demo", help="the main job on the embedded default (tiny GLM-5.2), end to end",
                       description="Make a tiny GLM-5.2, convert it to Megatron and back (checked against "
                                   "transformers), LoRA-SFT it on an embedded task (more 0s or 1s?), export the merged "
                                   "HF checkpoint, reload it in transformers and answer 60 held-out questions (exact "
                                   "match before → after training). Everything is "
                                   "written under WORKDIR (summary.json, sft/loss.png).")
    p.add_argument("--workdir", default="runs/demo", help="where everything is written")
    p.add_argument("--sft-steps", type=at_least(1), default=None, help="override the recipe's train.steps")
    p.set_defaults(fn=_demo)
    return parser


# Bad input, or the OS refusing (disk full, permissions): one line on stderr and exit status 2, no
# traceback. OSError covers FileNotFoundError and FileExistsError.
USER_ERRORS = (ValueError, OSError, NotImplementedError)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"glm5-bridge: warning: {message}\n"


def quiet_upstream_notices(debug: bool = False) -> None:
    """For this process only (the CLI's and the conversion scripts', never at `import glm5_bridge`):
    stderr carries glm5-bridge's own lines. Warnings raised by upstream code (TE / apex absent,
    deprecations, "No CUDA runtime", checkpoint API notices) and upstream log records are hidden;
    our own warnings still show. With `debug` everything shows, as it would without the CLI."""
    import logging
    import warnings

    if debug:
        return
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", module=r"glm5_bridge(\.|$)")
    warnings.formatwarning = _one_line_warning
    # upstream deprecations that surface through our frames (stacklevel): theirs to act on, not the user's
    warnings.filterwarnings("ignore", message=".*ModelProviderMixin-based model configuration is deprecated")
    # Log records of every library (their loggers set their own levels, so a parent's level is not
    # enough): failures still raise, and the error line names them. glm5-bridge reports by print.
    logging.disable(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def start_process(debug: bool = False) -> None:
    """What a glm5-bridge process does after parsing its arguments: upstream notices quieted, our
    bridge registered, the CPU / no-TE workarounds where they apply (the conversion scripts too)."""
    quiet_upstream_notices(debug)
    from glm5_bridge.process_stats import record_at_exit

    record_at_exit()  # only when $GLM5_BRIDGE_STATS names a file (benchmarks/real_width.py)
    import glm5_bridge  # after argparse and the filters: --help stays instant and quiet

    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()


def one_line_error(prog: str, error: BaseException) -> int:
    """A user error as the one stderr line every glm5-bridge command prints; the exit status (2)."""
    print(f"{prog}: error: {_first_line(error)}", file=sys.stderr)
    return 2


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def run_command(prog: str, fn, debug: bool) -> int:
    """`fn()` with every way out turned into an exit status and at most one stderr line: a user error
    (ValueError, OSError, ...: bad input named by file / key / shape) exits 2; anything else is a
    defect of ours or upstream's, exits 1 and names its type (`--debug` shows the traceback); Ctrl-C
    exits 130. Writes are atomic, so none of these leaves a partial output."""
    try:
        return fn() or 0
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        return one_line_error(prog, e)
    except SystemExit:
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if debug:
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {_first_line(e)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start_process(args.debug)
    return run_command(f"glm5-bridge {args.command}", lambda: args.fn(args), args.debug)


def entry() -> int:
    """The process entry point (`glm5-bridge`, `python -m glm5_bridge`): main, then the process
    group closed (NCCL warns at exit about one left open). Not in main(): the tests call main in a
    process whose gloo group outlives it."""
    code = main()
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(entry())
