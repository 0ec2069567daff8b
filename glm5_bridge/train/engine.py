"""The training engine the LoRA trainers run on: megatron-core's own machinery, nothing hand-written
in its place (docs/training.md says why each piece).

    engine = Engine(recipe)                           # this rank's model chunk, optimizer, scheduler
    metrics = engine.step(my_micro_batches, loss_fn)  # one optimizer step over a global batch
    engine.save(folder, step, history) / engine.load(folder)

- Processes: one per GPU (or CPU rank) under torchrun; gloo without CUDA, NCCL with it. World size =
  TP × PP × CP × DP as megatron-core defines it (`parallel_state.initialize_model_parallel`, reached
  through our provider).
- The model: megatron-bridge's provider builds this rank's pipeline stage, loads the HF weights and
  applies LoRA before wrapping (pre-wrap hooks), then megatron-core's `DistributedDataParallel` wraps
  it: the frozen base has no grad buffers; the adapters' grads are reduced in fp32 over DP.
- A step: `get_forward_backward_func()` (no pipelining, or 1F1B for PP > 1) over this rank's
  micro-batches, with per-token loss normalisation (`calculate_per_token_loss`): every micro-batch
  returns its summed loss and its loss-token count, `finalize_model_grads` all-reduces the count
  over DP and divides the gradients by it — so the loss of a step is the sum over the whole global
  batch divided by its token count, whatever the layout. Then `get_megatron_optimizer`'s Adam step
  (grad-norm clipping over TP/PP, optionally the distributed optimizer) and `OptimizerParamScheduler`.
- Checkpoints: `dist_checkpointing` of the adapters, the optimizer state (resharded when loaded at
  another layout) and the scheduler, plus each rank's RNG; written to a temporary folder and renamed
  into place by rank 0 after every rank has written (train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

from glm5_bridge import compat


def data_parallel_info() -> tuple[int, int]:
    """(rank, size) of this process among the ranks that train different micro-batches (data
    parallel; the context-parallel ranks of one replica share micro-batches and split their tokens)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def sequence_multiple(recipe) -> int:
    """What every packed sequence is padded to a multiple of: 2·CP·TP under context parallelism (each
    sequence splits into 2·CP equal chunks, each rank's share a multiple of TP), else 1. The packers
    count real tokens, so a padded micro-batch can exceed data.max_tokens a little (Engine.fit_all)."""
    m = recipe.model
    return 2 * m.context_parallel_size * m.tensor_model_parallel_size if m.context_parallel_size > 1 else 1


def token_multiple(recipe) -> int:
    """What a micro-batch's token count is padded to a multiple of: TP (sequence parallel splits
    the tokens), or sequence_multiple where that is larger (context parallel)."""
    return max(recipe.model.tensor_model_parallel_size, sequence_multiple(recipe))


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def init_distributed() -> torch.device:
    """The process group (torchrun's variables, or a lone process) and this process's device."""
    if not torch.cuda.is_available():
        compat.enable_cpu_support()
        compat.init_cpu_process_group()
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:  # a lone process
            from glm5_bridge.distributed import free_port

            torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                                 world_size=1)
        else:
            torch.distributed.init_process_group("nccl")
    return torch.device("cuda", local)


class Engine:
    """Model, optimizer and scheduler of one LoRA run on megatron-core, for this rank."""

    def __init__(self, recipe, **provider_overrides):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config, unwrap_model

        from glm5_bridge.model.bridge import AutoBridge
        from glm5_bridge.model.source import resolve
        from glm5_bridge.model.validate import validate_checkpoint
        from glm5_bridge.train.lora import GLM5LoRA, apply_lora, init_adapters_by_name, lora_parameters, lora_targets

        self.recipe = recipe
        m, t, lo = recipe.model, recipe.train, recipe.lora
        self.device = init_distributed()
        source = resolve(m.checkpoint)
        validate_checkpoint(source)
        self.bridge = AutoBridge.from_hf_pretrained(source)
        provider = self.bridge.to_megatron_provider(load_weights=True)
        fields = dict(dsa_attention_backend=m.dsa_attention_backend, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
                      tensor_model_parallel_size=m.tensor_model_parallel_size, dsa_token_parallel=m.dsa_token_parallel,
                      sequence_parallel=m.tensor_model_parallel_size > 1,
                      pipeline_model_parallel_size=m.pipeline_model_parallel_size,
                      expert_model_parallel_size=m.expert_model_parallel_size,
                      context_parallel_size=m.context_parallel_size,
                      calculate_per_token_loss=True)
        if m.context_parallel_size > 1 and m.mtp_loss_scaling_factor:
            import warnings

            # megatron-core 0.19 scales each rank's MTP loss by that rank's own (tokens before ÷ after
            # the roll); chunk boundaries make those differ per CP rank, so the MTP gradient is not
            # CP 1's (with the ratio forced to 1 the two agree: docs/parallel.md)
            warnings.warn("model.mtp_loss_scaling_factor under context parallelism: megatron-core normalises the "
                          "MTP loss per CP rank, so its gradient differs slightly from context_parallel_size 1",
                          UserWarning, stacklevel=2)
        if m.context_parallel_size > 1:
            fields["cp_comm_type"] = "allgather"  # megatron's DSA check; our core gathers kv rows itself
        if m.pipeline_stage_layers:
            stages = list(m.pipeline_stage_layers)
            if len(stages) != m.pipeline_model_parallel_size or sum(stages) != provider.num_layers:
                raise ValueError(f"model.pipeline_stage_layers {stages} must be {m.pipeline_model_parallel_size} "
                                 f"numbers summing to the {provider.num_layers} decoder layers")
            fields.update(num_layers_in_first_pipeline_stage=stages[0], num_layers_in_last_pipeline_stage=stages[-1])
            if len(set(stages[1:-1])) > 1:
                raise ValueError(f"model.pipeline_stage_layers {stages}: megatron splits the middle stages evenly; "
                                 "give equal sizes between the first and the last")
        unit = token_multiple(recipe)
        if m.pipeline_model_parallel_size > 1 and recipe.data.max_tokens % unit:
            what = "2 × CP × TP" if m.context_parallel_size > 1 else "TP"
            raise ValueError(f"data.max_tokens {recipe.data.max_tokens} must be a multiple of {what} = {unit} "
                             "under pipeline parallelism")
        # Always set: megatron-bridge takes the HF config's dtype, so a bf16 checkpoint (every real
        # one) would otherwise build bf16 parameters under an fp32 recipe and its fp32 optimizer.
        fields.update(bf16=m.bf16, params_dtype=torch.bfloat16 if m.bf16 else torch.float32)
        fields.update(provider_overrides)
        for key, value in fields.items():
            setattr(provider, key, value)
        provider.finalize()
        _initialize_model_parallel(provider, t.seed)

        lora = GLM5LoRA(dim=lo.dim, alpha=lo.alpha, dropout=lo.dropout,
                        target_modules=lora_targets(mla=lo.mla, dense_mlp=lo.dense_mlp,
                                                    shared_experts=lo.shared_experts, experts=lo.experts))
        hooks = [h for h in (provider.pre_wrap_hook, lambda chunks: [apply_lora(c, lora) for c in chunks]) if h]
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, pre_wrap_hook=hooks,
                                                    use_cpu_initialization=self.device.type == "cpu")
        if len(chunks) != 1:
            raise NotImplementedError("virtual pipeline stages (several model chunks per rank) are not supported")
        # Names as checkpoints know them: a bf16 chunk is wrapped in megatron's Float16Module, whose
        # parameter names gain "module." while its (sharded) state dict keeps the inner names.
        inner = unwrap_model(chunks[0])
        init_adapters_by_name(inner, t.seed)  # the same adapters at every layout and precision
        self.params = lora_parameters(inner)
        # megatron-bridge's own DDP wrapper opens CUDA streams; megatron-core's DDP needs none unless
        # it overlaps communication, which it does not here.
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=t.use_distributed_optimizer)
        self.model = [DistributedDataParallel(config=get_model_config(chunks[0]), ddp_config=ddp, module=chunks[0])]
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model[0].no_sync

        with compat.cuda_type_names():  # compat item 10
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                                clip_grad=t.grad_clip, use_distributed_optimizer=t.use_distributed_optimizer,
                                bf16=m.bf16, params_dtype=torch.bfloat16 if m.bf16 else torch.float32),
                self.model)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=t.lr / t.warmup_steps if t.warmup_steps else t.lr, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps, lr_decay_steps=max(t.steps, t.warmup_steps + 1), lr_decay_style="cosine",
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=max(t.steps, 1), wd_incr_style="constant")
        self.config = config

    # --- steps ---------------------------------------------------------------------------------
    def fit(self, batch, length: int = 0):
        """A micro-batch padded to what the layout needs: under context parallel every sequence to a
        multiple of 2·CP·TP (sequence_multiple), and the whole to a multiple of TP tokens (sequence
        parallel splits them) — or, under PP (pipeline stages exchange fixed shapes) or EP with the
        all-gather token dispatcher (the CPU's: EP ranks gather equal shapes), to at least
        data.max_tokens and `length`. fit_all fits a step's micro-batches together."""
        from glm5_bridge.train.data import pad_each_sequence, padded

        m = self.recipe.model
        unit = token_multiple(self.recipe)
        if m.context_parallel_size > 1:
            batch = pad_each_sequence(batch, unit)
        if self._fixed_shapes():
            return padded(batch, -(-max(self.recipe.data.max_tokens, length, batch.num_tokens) // unit) * unit)
        return padded(batch, -(-batch.num_tokens // unit) * unit)

    def fit_all(self, batches: list) -> list:
        """A step's micro-batches fitted; where shapes are fixed, all to one length: data.max_tokens,
        or more when context parallel's per-sequence pads take a micro-batch past it (the packers
        count real tokens, so which samples train together does not depend on the layout)."""
        fitted = [self.fit(b) for b in batches]
        longest = max((b.num_tokens for b in fitted), default=0)
        if not self._fixed_shapes() or all(b.num_tokens == longest for b in fitted):
            return fitted
        return [self.fit(b, longest) for b in batches]

    def _fixed_shapes(self) -> bool:
        m = self.recipe.model
        gathered_experts = m.expert_model_parallel_size > 1 and self.config.moe_token_dispatcher_type == "allgather"
        return m.pipeline_model_parallel_size > 1 or gathered_experts

    @property
    def chunk(self):
        """This rank's model chunk without the DDP wrapper (for forwards outside a step)."""
        return self.model[0].module

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, micro_batches: list, loss_fn: Callable, names: list[str], context=None) -> dict:
        """Forward + backward over this rank's micro-batches, then one optimizer step. `loss_fn(output,
        batch)` → (summed loss, loss-token count, {name: scalar tensor}) on the last pipeline stage;
        returns those `names` summed over the global batch (names ending in "_max": the max), the
        same on every rank, plus grad_norm and lr (the step's). `context(batch, packed_seq_params,
        model)`, when given, is a context manager each micro-batch's forward runs in (R3 replay)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.lr()
        reduced = self._run(micro_batches, loss_fn, forward_only=False, context=context)
        with compat.cuda_type_names():  # compat item 10
            _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = self.reduce(reduced, names)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr)
        return metrics

    def forward_only(self, micro_batches: list, loss_fn: Callable, names: list[str], context=None) -> tuple[dict, list]:
        """The same pass without gradients: (global metrics, this rank's per-micro-batch dicts: on the
        last stage, empty elsewhere)."""
        with torch.no_grad():
            reduced = self._run(micro_batches, loss_fn, forward_only=True, context=context)
        return self.reduce(reduced, names), reduced

    def _run(self, micro_batches: list, loss_fn: Callable, forward_only: bool, context=None) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro_batches:  # a DP rank with nothing to do (validation sets smaller than DP)
            return []
        lengths = {b.num_tokens for b in micro_batches}
        if self.config.pipeline_model_parallel_size > 1 and len(lengths) > 1:
            raise ValueError(f"pipeline stages exchange fixed shapes: micro-batches of {sorted(lengths)} tokens")
        return get_forward_backward_func()(
            forward_step_func=self._forward_step(loss_fn, context), data_iterator=iter(micro_batches),
            model=self.model, num_microbatches=len(micro_batches), seq_length=max(lengths), micro_batch_size=1,
            forward_only=forward_only) or []

    def _forward_step(self, loss_fn, context=None):
        device = self.device

        mtp = bool(self.config.mtp_num_layers and self.config.mtp_loss_scaling_factor)

        def forward_step(data_iterator, model):
            batch = next(data_iterator).to(device)
            psp = batch.packed_seq_params(device)  # the whole sequences, under CP too
            if mtp:  # the MTP loss's tokens: the main loss's, seen from the input side
                from glm5_bridge.train.data import mtp_loss_mask

                batch.mtp_loss_mask = mtp_loss_mask(batch)
            if self.recipe.model.context_parallel_size > 1:  # this rank's chunks of every sequence
                from megatron.core import parallel_state

                from glm5_bridge.model.attention.context_parallel import local_rows

                rows = local_rows(tuple(batch.lengths), parallel_state.get_context_parallel_world_size(),
                                  parallel_state.get_context_parallel_rank(), device)
                batch = batch.take(rows)
                batch.token_rows = rows  # per-sample payloads (routed experts) follow the same rows
            extra = {"loss_mask": batch.mtp_loss_mask} if mtp else {}
            with context(batch, psp, model) if context else contextlib.nullcontext():
                output = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                               packed_seq_params=psp, **extra)
            return output, lambda out: loss_fn(out, batch)

        return forward_step

    def reduce(self, per_micro_batch: list[dict], names: list[str]) -> dict:
        """Sum (or max, for "*_max") this rank's micro-batch metrics, then over DP, then hand the last
        pipeline stage's numbers to every stage: every rank returns the same dict of floats."""
        from megatron.core import parallel_state

        pp_group = parallel_state.get_pipeline_model_parallel_group()
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        maxes = torch.full((len(names),), float("-inf"), dtype=torch.float64, device=self.device)
        for d in per_micro_batch:
            for i, name in enumerate(names):
                if name in d:
                    value = d[name].detach().to(self.device, torch.float64).reshape(())
                    sums[i] += value
                    maxes[i] = torch.maximum(maxes[i], value)
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(sums, group=dp)
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=dp)
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(sums, src=last, group=pp_group)
        torch.distributed.broadcast(maxes, src=last, group=pp_group)
        return {n: float(maxes[i] if n.endswith("_max") else sums[i]) for i, n in enumerate(names)}

    # --- checkpoints (train/checkpoint.py writes and reads the folders) -------------------------------
    def sharded_state(self, loading: bool = False) -> dict:
        """What a checkpoint holds, as megatron's dist_checkpointing wants it: the adapters, the
        optimizer state mapped onto them, the scheduler."""
        model = {k: v for k, v in self.chunk.sharded_state_dict().items() if ".adapter." in k}
        metadata = None
        if self.recipe.train.use_distributed_optimizer:  # reshardable at load; over gloo without CUDA
            metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                        "distrib_optim_fully_reshardable_mem_efficient": self.device.type == "cpu"}
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, **({"metadata": metadata} if metadata else {}))
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def restore(self, loaded: dict) -> None:
        missing = set(self.params) - {k for k in loaded["model"] if not k.endswith("_extra_state")}
        if missing:
            raise ValueError(f"checkpoint lacks adapter {sorted(missing)[0]} (was the LoRA config changed?)")
        self.chunk.load_state_dict(loaded["model"], strict=False)
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])


def _initialize_model_parallel(provider, seed: int) -> None:
    """megatron's parallel state for this layout; a process that already holds another layout (a
    test, a notebook) gives it up first."""
    from megatron.core import parallel_state as ps

    wanted = (provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size,
              provider.expert_model_parallel_size, provider.context_parallel_size)
    if ps.model_parallel_is_initialized():
        held = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
        if held == wanted:
            _seed(seed)
            return
        ps.destroy_model_parallel()
    provider.initialize_model_parallel(seed=seed)


def _seed(seed: int) -> None:
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        compat.cpu_seed(seed)

