"""Recipe schema: YAML files under recipes/ are merged onto these dataclasses with OmegaConf, so an
unknown key or a wrong type is an error that names the key (a typo never silently does nothing).

    recipe = load_recipe("recipes/glm52_lora_sft.yaml", ["train.steps=20", "lora.dim=8"])

A recipe may name a base recipe with a top-level `base:` key (a path relative to the recipe file,
e.g. `base: base/lora_sft.yaml`): the base is loaded first and the recipe's own values are merged
on top, then the overrides. A base may name a base of its own; a cycle is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError


@dataclass
class ModelConfig:
    checkpoint: str = "runs/demo/hf"  # HF checkpoint folder
    dsa_attention_backend: str = "megatron"  # "megatron" (unfused, any device) | "tilelang" (GPU, thd)
    tensor_model_parallel_size: int = 1
    # TP > 1: sparse attention split by tokens, not heads; null: on with "tilelang" without CP
    dsa_token_parallel: bool | None = None
    pipeline_model_parallel_size: int = 1
    # Decoder layers per pipeline stage (first, …, last; the middle stages equal), e.g. [14, 16, 16,
    # 16, 16]; empty = megatron's even split. A stage may not start on an IndexShare "shared" layer.
    pipeline_stage_layers: list[int] = field(default_factory=list)
    expert_model_parallel_size: int = 1
    # Context parallel (SFT and RL): every packed sequence split over CP ranks, DSA keys gathered per layer
    # (model/attention/context_parallel.py); sequences are padded to multiples of 2 × CP (× TP).
    context_parallel_size: int = 1
    mtp_loss_scaling_factor: float = 0.0  # LoRA fine-tuning trains the main LM loss only by default
    bf16: bool = False  # parameters in bf16 (GPU); fp32 otherwise


@dataclass
class LoraConfig:
    dim: int = 16
    alpha: int = 32
    dropout: float = 0.0
    mla: bool = True  # q_a / q_b / kv_a / kv_b / o projections
    dense_mlp: bool = False
    shared_experts: bool = False
    experts: bool = False


@dataclass
class DataConfig:
    train: str = "arithmetic"  # chat jsonl (SFT) or rollout jsonl (RL); "arithmetic": the embedded chat data
    valid: str = ""  # validation chat jsonl (SFT): its loss every train.eval_every steps
    max_tokens: int = 512  # tokens per packed micro-batch
    limit: int = 0  # use only the first N samples (0 = all)
    seed: int = 0


@dataclass
class TrainConfig:
    steps: int = 30
    # Packed micro-batches (data.max_tokens tokens each) per optimizer step, summed over the data-
    # parallel ranks: each DP rank runs global_batch_size / DP of them. The step's loss is the summed
    # token NLL of the whole global batch over its loss-token count, whatever the layout.
    global_batch_size: int = 1
    use_distributed_optimizer: bool = False  # shard the Adam state over DP (megatron's distributed optimizer)
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    save_every: int = 10  # checkpoint every N steps (0 = only at the end)
    output_dir: str = "runs/sft"
    resume: bool = True  # continue from output_dir/checkpoints/latest when present
    eval_every: int = 0  # validation loss every N steps (needs data.valid; 0 = never)
    tensorboard_dir: str = ""  # default {output_dir}/tensorboard; "none" turns it off
    wandb_project: str = ""  # log to Weights & Biases too (when wandb is installed)
    # GPU memory to plan the layout against before building the model (glm5_bridge/train/plan.py): 0 = the
    # device's own on a GPU; no check on a CPU.
    gpu_memory_gib: float = 0.0
    # torch.use_deterministic_algorithms: bit-exact repeats and resumes (the CPU gather backward
    # otherwise sums in thread order, ~1e-7 apart run to run); on GPU it may cost speed.
    deterministic: bool = False


@dataclass
class ExportConfig:
    kind: str = "merged"  # merged | adapter | none
    dir: str = ""  # default: {train.output_dir}/export_{kind}


@dataclass
class RLConfig:
    clip_eps: float = 0.2  # GRPO/PPO ratio clip
    kl_coef: float = 0.0  # KL(policy ‖ reference) penalty; the reference is the base model (LoRA off)
    replay: bool = True  # replay the rollout's indexer top-k when the rollout carries it
    # with replay: the rollout's routed experts too, when it carries them (off: indexer top-k only)
    replay_routes: bool = True
    # stream the rollout file's top-k into a compact store ({output_dir}/replay/) and replay from it
    # a layer at a time: host memory a block of rows instead of every payload (docs/replay.md)
    replay_store: bool = False
    # colocated: no rollout file; transformers generates from the policy's merged weights each step
    # (prompts: the embedded arithmetic problems), see train/colocated.py.
    colocated: bool = False
    prompts_per_step: int = 4
    samples_per_prompt: int = 2
    max_new_tokens: int = 4
    rollout_indexer_dtype: str = "float32"  # "bfloat16" emulates an engine's low-precision indexer


@dataclass
class Recipe:
    task: str = "sft"  # sft | rl
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    rl: RLConfig = field(default_factory=RLConfig)


SHIPPED = Path(__file__).resolve().parents[1] / "recipes"


def find_recipe(name: str | Path) -> Path:
    """A recipe file: the path itself when it exists, else a shipped recipe of that name
    (`tiny_lora_sft` or `tiny_lora_sft.yaml`); a one-line error naming both places otherwise."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (SHIPPED / path.name, SHIPPED / f"{path.name}.yaml"):
        if candidate.is_file() and path.parent == Path("."):
            return candidate
    shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
    raise FileNotFoundError(f"{name}: recipe file not found (and not a shipped recipe: {shipped})")


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """The recipe at `path` (YAML) with dotted `overrides` ("train.steps=20") applied, validated."""
    schema = OmegaConf.structured(Recipe)
    merged, where = schema, ""
    try:
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path}: recipe file not found")
            for layer, values in _with_bases(path, schema):  # base first, the recipe itself last
                where = f"{layer}: "
                merged = OmegaConf.merge(merged, values)
        for item in overrides or []:  # one at a time, so an error names the override it came from
            where = f"override {item}: "
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
    except (ConfigKeyError, ValidationError) as e:
        key = f" (key: {e.full_key})" if e.full_key else ""
        raise ValueError(f"{where}{(e.msg or str(e)).splitlines()[0]}{key}") from None
    recipe: Recipe = OmegaConf.to_object(merged)
    if recipe.task not in ("sft", "rl"):
        raise ValueError(f"task must be sft or rl, got {recipe.task!r}")
    if recipe.export.kind not in ("merged", "adapter", "none"):
        raise ValueError(f"export.kind must be merged, adapter or none, got {recipe.export.kind!r}")
    _check_ranges(recipe)
    return recipe


# Values the schema's types allow but a run cannot use: (section.key, test, what it must be).
_RANGES = [
    ("train.steps", lambda v: v >= 1, "at least 1"), ("train.global_batch_size", lambda v: v >= 1, "at least 1"),
    ("train.lr", lambda v: v >= 0, "≥ 0"), ("train.min_lr", lambda v: v >= 0, "≥ 0"),
    ("train.warmup_steps", lambda v: v >= 0, "≥ 0"), ("train.save_every", lambda v: v >= 0, "≥ 0"),
    ("train.eval_every", lambda v: v >= 0, "≥ 0"), ("train.grad_clip", lambda v: v >= 0, "≥ 0"),
    ("train.weight_decay", lambda v: v >= 0, "≥ 0"), ("train.gpu_memory_gib", lambda v: v >= 0, "≥ 0"),
    ("lora.dim", lambda v: v >= 1, "at least 1"), ("lora.alpha", lambda v: v > 0, "> 0"),
    ("lora.dropout", lambda v: 0 <= v < 1, "in [0, 1)"), ("data.max_tokens", lambda v: v >= 2, "at least 2"),
    ("data.limit", lambda v: v >= 0, "≥ 0 (0 = all)"),
    ("model.tensor_model_parallel_size", lambda v: v >= 1, "at least 1"),
    ("model.pipeline_model_parallel_size", lambda v: v >= 1, "at least 1"),
    ("model.expert_model_parallel_size", lambda v: v >= 1, "at least 1"),
    ("model.context_parallel_size", lambda v: v >= 1, "at least 1"),
    ("rl.clip_eps", lambda v: 0 < v < 1, "in (0, 1)"), ("rl.kl_coef", lambda v: v >= 0, "≥ 0"),
    ("rl.prompts_per_step", lambda v: v >= 1, "at least 1"), ("rl.samples_per_prompt", lambda v: v >= 1, "at least 1"),
    ("rl.max_new_tokens", lambda v: v >= 1, "at least 1"),
]


def _check_ranges(recipe: Recipe) -> None:
    import math

    for key, ok, what in _RANGES:
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        if isinstance(value, float) and not math.isfinite(value) or not ok(value):
            raise ValueError(f"{key} must be {what}, got {value!r} (key: {key})")


def _with_bases(path, schema) -> list:
    """[(file, its mapping without `base:`)] for the recipe at `path` and the bases it names, the
    outermost base first. A base that is missing, not a string or closes a cycle is one line naming
    the file that names it."""
    layers, chain = [], [Path(path)]
    while True:
        loaded = _load_yaml(path, schema)
        base = loaded.pop("base", None)
        layers.append((path, loaded))
        if base is None:
            return layers[::-1]
        if not isinstance(base, str) or not base:
            raise ValueError(f"{path}: base must be the path of a recipe file, got {base!r} (key: base)")
        base_path = Path(os.path.normpath(Path(path).parent / base))
        if not base_path.is_file():
            raise ValueError(f"{path}: base recipe {base_path} not found (key: base)")
        if any(base_path.resolve() == seen.resolve() for seen in chain):
            cycle = " → ".join(str(p) for p in [*chain, base_path])
            raise ValueError(f"{path}: base recipes form a cycle ({cycle}) (key: base)")
        chain.append(base_path)
        path = base_path


def _load_yaml(path, schema):
    """The YAML file as an OmegaConf mapping; a syntax error or a section given a plain value is
    one line naming the file (and the key)."""
    import yaml
    from omegaconf import DictConfig

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"{path}: expected a mapping of sections ({', '.join(schema.keys())}), "
                         f"got a {type(loaded).__name__}")
    for key, value in loaded.items_ex(resolve=False):
        if isinstance(schema.get(key), DictConfig) and not isinstance(value, DictConfig):
            raise ValueError(f"{path}: {key} must be a section (a mapping), got {value!r} (key: {key})")
    return loaded


def to_yaml(recipe: Recipe) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))
