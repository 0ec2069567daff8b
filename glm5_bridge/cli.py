"""`glm5-bridge` command line. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import functools
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
    from glm5_bridge.parity import logits_parity

    diff = logits_parity(args.checkpoint, seq_len=args.seq_len, batch=args.batch)
    print(f"max |logits(Megatron) - logits(transformers)| = {diff:.3e}  (seq_len {args.seq_len})")
    return 0 if diff <= args.tol else 1


def _make_tiny(args):
    from glm5_bridge.tiny import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.variant, args.dst, seed=args.seed))


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
    from glm5_bridge.train.export import export_adapter, export_merged
    from glm5_bridge.train.recipe import load_recipe

    run = Path(args.run)
    if Path(args.dst).exists() and not args.overwrite:  # before the (long) model build
        raise FileExistsError(f"{args.dst}: already exists (pass --overwrite to replace it)")
    recipe = load_recipe(run / "recipe.yaml")
    saved = checkpoint.latest(run / "checkpoints")
    if saved is None:
        raise FileNotFoundError(f"{run}/checkpoints: no checkpoint to export")
    engine = Engine(recipe)
    checkpoint.load(saved, engine)
    write = export_adapter if args.kind == "adapter" else export_merged
    print(f"{args.kind} export written to {write(engine.bridge, engine.chunk, args.dst, overwrite=args.overwrite, show_progress=True)}")


def _plan(args):
    from glm5_bridge.model.config import load_hf_config
    from glm5_bridge.train.plan import GPU_MEMORY_GIB, Plan, count_parameters, memory_per_gpu, verdict

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
        return 0 if fits else 1


def _demo(args):
    from glm5_bridge.demo import run

    return run(args.workdir, sft_steps=args.sft_steps)


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from glm5_bridge import __version__

    parser = argparse.ArgumentParser(prog="glm5-bridge", description="GLM-5 / 5.1 / 5.2 with Megatron.")
    parser.add_argument("--version", action="version", version=f"glm5-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_DefaultsShown)

    p = sub.add_parser("convert", help="HF checkpoint → Megatron distributed checkpoint, or back",
                       description="Convert an HF GLM-5.x checkpoint folder into a Megatron distributed "
                                   "checkpoint, or (when SRC was written by this command) back into HF format. "
                                   "The source is only read; DST appears only once complete.")
    p.add_argument("src", help="HF checkpoint folder, or a Megatron checkpoint written by this command")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron side")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(fn=_convert)

    p = sub.add_parser("parity", help="compare Megatron logits with transformers on a checkpoint",
                       description="Load CKPT in Megatron (our bridge) and in transformers, run the same random "
                                   "tokens through both in fp32 and print the max abs logit difference. Exit 1 if "
                                   "it is above --tol.")
    p.add_argument("checkpoint", help="HF checkpoint folder")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences")
    p.add_argument("--tol", type=float, default=1e-5, help="largest acceptable max |logit difference|")
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
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(fn=_export)

    p = sub.add_parser("plan", help="parameters and per-GPU memory of a GLM-5.x model for a parallel layout",
                       description="Count parameters from config.json (a preset or a checkpoint folder) and estimate "
                                   "memory on the busiest GPU for LoRA training (bf16 frozen weights, fp32 adapters "
                                   "with Adam, activations with full recompute; see glm5_bridge/train/plan.py). Refuses "
                                   "pipeline splits where a stage would start on an IndexShare 'shared' layer.")
    p.add_argument("model", help='"GLM-5", "GLM-5.1", "GLM-5.2" or a checkpoint folder')
    for flag, default, what in (("--tp", 8, "tensor"), ("--pp", 1, "pipeline"), ("--ep", 8, "expert"),
                                ("--cp", 1, "context")):
        p.add_argument(flag, type=int, default=default, help=f"{what}-parallel size")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--lora-dim", type=int, default=64, help="LoRA rank")
    p.add_argument("--stages", help="decoder layers per PP stage, comma separated (default: even split)")
    p.add_argument("--gpu", choices=["H100", "H200", "A100", "B200"],
                   help="give a fits / does-not-fit verdict for this GPU (exit status 1 when it does not fit)")
    p.add_argument("--gpu-memory-gib", type=float, default=0.0, help="the same for a GPU of this much memory")
    p.set_defaults(fn=_plan)

    p = sub.add_parser("make-tiny", help="write a tiny random GLM-5.x HF checkpoint (for tests and demos)")
    p.add_argument("variant", choices=["GLM-5", "GLM-5.1", "GLM-5.2"], help="whose config (and IndexShare) to copy")
    p.add_argument("dst", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")
    p.set_defaults(fn=_make_tiny)

    p = sub.add_parser("demo", help="the main job on the embedded default (tiny GLM-5.2), end to end",
                       description="Make a tiny GLM-5.2, convert it to Megatron and back (checked against "
                                   "transformers), LoRA-SFT it on the embedded arithmetic data, export the merged HF "
                                   "checkpoint, reload it in transformers and answer a few prompts. Everything is "
                                   "written under WORKDIR (summary.json, sft/loss.png).")
    p.add_argument("--workdir", default="runs/demo", help="where everything is written")
    p.add_argument("--sft-steps", type=int, default=None, help="override the recipe's train.steps")
    p.set_defaults(fn=_demo)
    return parser


# Bad input, or the OS refusing (disk full, permissions): one line on stderr and exit status 2, no
# traceback. OSError covers FileNotFoundError and FileExistsError.
USER_ERRORS = (ValueError, OSError, NotImplementedError)


def quiet_upstream_notices() -> None:
    """Import-time notices from megatron about optional packages we deliberately run without (TE,
    apex, absl, modelopt's transformers pin), for this process only: the CLI's, never at
    `import glm5_bridge`. Real warnings still show."""
    import logging
    import warnings

    for pattern in ("Transformer Engine and Apex", "Apex is not installed", "absl.logging", "transformer-engine>=",
                    "is not tested with current version of modelopt", "`torch.jit.script` is deprecated",
                    "ModelProviderMixin-based model configuration is deprecated", "No CUDA runtime is found"):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")
    for logger in ("megatron.bridge.utils.import_utils", "megatron.bridge.models.gemma.gemma2_provider",
                   "megatron.core.distributed.param_and_grad_buffer", "megatron.core.distributed.distributed_data_parallel",
                   "megatron.bridge.peft.lora", "megatron.core.optimizer"):
        logging.getLogger(logger).addFilter(lambda record: record.levelno >= logging.WARNING)
    for logger, notice in (("megatron.core.models.gpt.gpt_model", "IS DEPRECATED"),
                           ("megatron.core.dist_checkpointing.strategies.torch", "async save is deprecated")):
        logging.getLogger(logger).addFilter(lambda record, notice=notice: notice not in record.getMessage())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "torch_dtype is deprecated" and load reports


def start_process() -> None:
    """What a glm5-bridge process does after parsing its arguments: upstream notices quieted, our
    bridge registered, the CPU / no-TE workarounds where they apply (the conversion scripts too)."""
    quiet_upstream_notices()
    import glm5_bridge  # after argparse and the filters: --help stays instant and quiet

    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()


def one_line_error(prog: str, error: Exception) -> int:
    """A user error as the one stderr line every glm5-bridge command prints; the exit status (2)."""
    print(f"{prog}: error: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start_process()

    try:
        return args.fn(args) or 0
    except USER_ERRORS as e:
        return one_line_error(f"glm5-bridge {args.command}", e)


if __name__ == "__main__":
    sys.exit(main())
