"""Megatron vs transformers on the same checkpoint: the numbers behind `glm5-bridge parity`.

Two measures:
- `logits_parity`: max |logit diff| in fp32 on random tokens (bshd), both sides computing in fp32
  whatever dtype the checkpoint stores: the CPU check that the model is the same function.
- `logprob_parity`: next-token log-prob |diff| (max, median, p99) on packed sequences (thd), Megatron
  computing in `dtype` with a DSA backend against transformers in fp32 on the same weights, next to
  the floor: the same transformers model in bf16 against fp32. A Megatron bf16 model whose diff
  is within a small multiple of that floor is as close to the reference as bf16 arithmetic lets any
  implementation be. The Megatron side may be a training run (its LoRA adapters on), the
  transformers side an export (merged weights, or the base with a PEFT adapter).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch


def megatron_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids → [b, s, vocab] logits (bshd, causal, default positions)."""
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


FP32 = dict(params_dtype=torch.float32, bf16=False)  # provider fields: compute in fp32 whatever the checkpoint stores


def logits_parity(checkpoint, seq_len: int = 64, batch: int = 2, seed: int = 0, **provider_overrides) -> float:
    """Max abs difference of fp32 logits on random tokens (bshd, causal)."""
    from glm5_bridge.model.bridge import build_megatron_model
    from glm5_bridge.hf import load_hf

    _, model = build_megatron_model(checkpoint, **{**FP32, **provider_overrides})
    hf = load_hf(checkpoint)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = megatron_logits(model.eval(), ids)
        ref = hf(input_ids=ids).logits
    return (ours.float() - ref.float()).abs().max().item()


def _stats(diff: torch.Tensor) -> dict:
    d = diff.double().cpu()
    return {"max": d.max().item(), "median": d.median().item(), "p99": torch.quantile(d, 0.99).item(),
            "mean": d.mean().item()}


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """[s, V] logits of one sequence, [s] ids → ([s − 1] log p(ids[t+1] | ids ≤ t), [s − 1] the
    largest next-token probability), fp32, on the logits' device (chunked: a full-vocabulary fp32
    softmax of 8K tokens is 5 GB)."""
    out, peak = [], []
    for start in range(0, ids.shape[0] - 1, chunk):
        rows = slice(start, min(start + chunk, ids.shape[0] - 1))
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        out.append(lp.gather(-1, ids[rows.start + 1: rows.stop + 1, None])[:, 0])
        peak.append(lp.amax(-1).exp())
    return torch.cat(out), torch.cat(peak)


def _release_memory() -> None:
    """Give the memory of models the caller has just dropped back (host and GPU caches)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _megatron_logprobs(model, sequences: list[torch.Tensor], device) -> torch.Tensor:
    from glm5_bridge.train.data import packed_seq_params

    ids = torch.cat(sequences).to(device)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).to(device)[None]
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, position_ids=positions, attention_mask=None,
                              packed_seq_params=packed_seq_params([len(s) for s in sequences], device))[0]
    out, start = [], 0
    for s in sequences:
        out.append(_next_token_logprobs(logits[start:start + len(s)], ids[0, start:start + len(s)])[0])
        start += len(s)
    return torch.cat(out).cpu()


def _hf_logprobs(folder, sequences: list[torch.Tensor], dtype: torch.dtype, device, adapter=None) -> tuple:
    """(next-token log-probs, median next-token max probability) of transformers on `folder`
    (with a PEFT `adapter` on top when given), one sequence at a time."""
    from glm5_bridge.hf import load_hf

    model = load_hf(folder, dtype=dtype).to(device)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    out, peaks = [], []
    with torch.no_grad():
        for s in sequences:
            logits = model(input_ids=s.to(device)[None]).logits[0]
            logprobs, peak = _next_token_logprobs(logits, s.to(device))
            out.append(logprobs.cpu())
            peaks.append(peak.cpu())
            del logits
    del model
    _release_memory()
    return torch.cat(out), (torch.cat(peaks).median().item() if dtype == torch.float32 else None)


def random_sequences(lengths: list[int], vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def logprob_parity(checkpoint, lengths: list[int], dtype: str = "bfloat16", backend: str = "megatron", seed: int = 0,
                   run=None, hf=None, adapter=None) -> dict:
    """Next-token log-probs of `lengths` random packed sequences: Megatron (`checkpoint`, or the
    training `run`'s latest checkpoint with its adapters, computing in `dtype` with DSA `backend`)
    against transformers in fp32 on `hf` (default: `checkpoint`; with a PEFT `adapter` on top), and
    the floor: transformers in bf16 against fp32. Returns the numbers (see the module docstring)."""
    from glm5_bridge.model.config import load_hf_config

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch_dtype = getattr(torch, dtype)
    hf = hf or checkpoint
    sequences = random_sequences(lengths, load_hf_config(checkpoint).vocab_size, seed)
    precision = dict(params_dtype=torch_dtype, bf16=torch_dtype == torch.bfloat16)
    if run is not None:
        model = _trained_model(run, backend, precision)
    else:
        from glm5_bridge.model.bridge import build_megatron_model

        _, model = build_megatron_model(checkpoint, dsa_attention_backend=backend, mtp_loss_scaling_factor=0.0,
                                        **precision)
    ours = _megatron_logprobs(model, sequences, device)
    del model
    _release_memory()
    ref, peak = _hf_logprobs(hf, sequences, torch.float32, device, adapter)
    low, _ = _hf_logprobs(hf, sequences, torch.bfloat16, device, adapter)  # the floor is always bf16's
    same = ref if torch_dtype == torch.float32 else low
    result = {"lengths": list(lengths), "tokens": sum(lengths), "dtype": dtype, "backend": backend,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "megatron_vs_hf_fp32": _stats((ours - ref).abs()),
              "megatron_vs_hf_same_dtype": _stats((ours - same).abs()),
              "floor_hf_bf16_vs_fp32": _stats((low - ref).abs()),
              "next_token_max_prob_median": peak}
    floor = result["floor_hf_bf16_vs_fp32"]["max"]
    result["max_over_floor_max"] = result["megatron_vs_hf_fp32"]["max"] / floor if floor > 0 else None
    return result


def _trained_model(run, backend: str, precision: dict):
    """The model chunk of a training run's latest checkpoint, adapters on."""
    from glm5_bridge.train import checkpoint
    from glm5_bridge.train.engine import Engine
    from glm5_bridge.train.recipe import load_recipe

    run = Path(run)
    recipe = load_recipe(run / "recipe.yaml", [f"model.dsa_attention_backend={backend}",
                                              f"model.bf16={str(precision['bf16']).lower()}"])
    saved = checkpoint.latest(run / "checkpoints")
    if saved is None:
        raise FileNotFoundError(f"{run}/checkpoints: no checkpoint to compare")
    engine = Engine(recipe)
    checkpoint.load(saved, engine)
    return engine.chunk
