"""Model-level DSA benchmark: a 1-layer model fwd+bwd and a 5-layer LoRA train step, GLM-5.2
attention dims, per attention backend / kernel set, in one run.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_layer.py [--out $OUT/bench_layer.json]
    .venv/bin/python benchmarks/bench_layer.py --smoke      # CPU: tiny dims, megatron backend only

Models: GLM-5.2's config.json (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, qk 192+64, v 256,
indexer 32×128, top-k 2048, IndexShare schedule), random bf16 weights, reduced so they fit one GPU
next to 16K tokens of activations: 8 routed experts (top-2) instead of 256 (top-8), vocab 32768
instead of 154880, no MTP layer. Layers 0-2 have dense MLPs (first_k_dense_replace = 3); of the
5 layers, 0-2 run an indexer and 3-4 reuse layer 2's top-k.
  layer:  1-layer model (embedding, one DSA layer with dense MLP, output layer), fwd and fwd+bwd
          over one packed micro-batch (thd), all parameters trainable;
  lora:   5-layer model with LoRA on the MLA projections (glm5_bridge.train.lora defaults), one optimizer
          step per micro-batch: tokens/s.
Backends: "tilelang" with $GLM5_DSA_KERNELS=ours and =upstream, and "megatron" (unfused) where
it fits (the 1-layer model at ≤ 8K tokens). Medians of CUDA-event times after a warm-up.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import times_ms  # noqa: E402  (benchmarks/timing.py, beside this script)

ROWS = []


def emit(out_path, **row):
    ROWS.append(row)
    print("RESULT " + json.dumps(row), flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(ROWS, indent=1))


def write_config(folder: Path, layers: int, smoke: bool) -> Path:
    from glm5_bridge.model.config import load_preset_dict

    cfg = load_preset_dict("GLM-5.2")
    cfg.update(num_hidden_layers=layers, n_routed_experts=8, num_experts_per_tok=2, vocab_size=32768,
               num_nextn_predict_layers=0, indexer_types=cfg["indexer_types"][:layers], dtype="bfloat16")
    if smoke:  # CPU: the tiny test model's sizes, same schedule
        from glm5_bridge.tiny import TINY

        keep = ("initializer_range", "num_hidden_layers")
        cfg.update({k: v for k, v in TINY.items() if k not in keep}, vocab_size=256,
                   qk_head_dim=TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"], head_dim=TINY["qk_rope_head_dim"],
                   dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def build(path, backend, smoke):
    from glm5_bridge.testing import load_megatron

    extra = {} if smoke else dict(bf16=True, params_dtype=torch.bfloat16)
    return load_megatron(path, load_weights=False, dsa_attention_backend=backend, **extra)[1]


def batch(lengths, vocab, device):
    from glm5_bridge.train.data import packed_seq_params

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g).to(device)[None]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    params = packed_seq_params(lengths)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.to(device)
    return dict(input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=params)


def timed(fn, reps, device):
    """Median ms after one warm-up call (kernel builds load from TileLang's cache)."""
    return statistics.median(times_ms(fn, reps, warmup=1, device=device))


def loss_of(model, mb):
    logits = model(**mb)
    return logits.float().logsumexp(-1).mean()  # any scalar that touches every logit


def bench_layer(path, backend, lengths, reps, device, smoke, out):
    model = build(path, backend, smoke)
    mb = batch(lengths, 256 if smoke else 32768, device)

    def fwd():
        with torch.no_grad():
            model(**mb)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        loss_of(model, mb).backward()

    t_f = timed(fwd, reps, device)
    t_fb = timed(fwd_bwd, max(1, reps // 2), device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    emit(out, part="layer", backend=backend, kernels=os.environ.get("GLM5_DSA_KERNELS", "default"),
         tokens=sum(lengths), lengths="+".join(map(str, lengths)), fwd_ms=round(t_f, 2), fwd_bwd_ms=round(t_fb, 2),
         tokens_per_s_fwd_bwd=round(sum(lengths) / t_fb * 1e3), peak_gib=peak and round(peak, 1))
    del model


def bench_lora(path, backend, lengths, reps, device, smoke, out):
    from glm5_bridge.train.lora import apply_lora, lora_parameters

    model = build(path, backend, smoke)
    apply_lora(model)
    params = list(lora_parameters(model).values())
    opt = torch.optim.AdamW(params, lr=1e-4)
    mb = batch(lengths, 256 if smoke else 32768, device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(model, mb).backward()
        opt.step()

    t = timed(step, reps, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    emit(out, part="lora_step", backend=backend, kernels=os.environ.get("GLM5_DSA_KERNELS", "default"),
         layers=5, tokens=sum(lengths), lengths="+".join(map(str, lengths)), step_ms=round(t, 1),
         tokens_per_s=round(sum(lengths) / t * 1e3), lora_params=sum(p.numel() for p in params),
         peak_gib=peak and round(peak, 1))
    del model, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims, megatron backend")
    ap.add_argument("--parts", default="layer,lora")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_layer.json"))
    a = ap.parse_args()
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()

    device = "cpu" if a.smoke else "cuda"
    runs = [("megatron", None)] if a.smoke else [("tilelang", "ours"), ("tilelang", "upstream"), ("megatron", None)]
    layer_lengths = [60, 40] if a.smoke else [4096, 4096]
    lora_lengths = [60, 40] if a.smoke else [8192, 4096, 4096]
    with tempfile.TemporaryDirectory() as tmp:
        one = write_config(Path(tmp) / "one", 1, a.smoke)
        five = write_config(Path(tmp) / "five", 5, a.smoke)
        for backend, kernels in runs:
            if kernels:
                os.environ["GLM5_DSA_KERNELS"] = kernels
            else:
                os.environ.pop("GLM5_DSA_KERNELS", None)
            if "layer" in a.parts:
                bench_layer(one, backend, layer_lengths, 1 if backend == "megatron" else a.reps, device, a.smoke, a.out)
            if "lora" in a.parts and (backend != "megatron" or a.smoke):  # unfused at 16K: > 200 GiB
                bench_lora(five, backend, lora_lengths, a.reps, device, a.smoke, a.out)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
