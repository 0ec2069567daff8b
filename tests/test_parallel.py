"""Tensor (+ sequence), expert and pipeline parallelism on the tiny GLM-5.2 (fp32), each checked
against the single-rank model on the same inputs, and HF ⇄ Megatron conversion straight into and
out of TP=2 / EP=2 / PP=2 shards.

Each case is one function run on every rank; it computes the reference first (TP=1 / EP=1 / PP=1,
every rank alone as a data-parallel replica) and then the parallel model, and returns plain CPU
tensors; the `check_*` functions compare them. Two ways to run the same cases and checks:
  - pytest (CI, CPU): `run_local_ranks` starts 2 gloo processes once (a module-scoped fixture) and
    they run every case; skipped where CUDA is available;
  - `torchrun --nproc-per-node N tests/test_parallel.py` (N = 2 or 4): NCCL on one GPU per rank
    when CUDA is there, gloo otherwise. scripts/multi_gpu.sh runs it on 2 and 4 GPUs.

What each case checks:
  - TP=2 + sequence parallel + LoRA (default MLA targets, every A and B non-zero): 10 AdamW steps on
    the adapters give TP=1's loss at every step, and every adapter gradient (kv_b_proj A and B
    among them, TP shards gathered) equals TP=1's at every step;
  - EP=2 (TP=1, allgather dispatcher on CPU): each rank's logits, loss and gradients equal EP=1's on
    that rank's tokens; an expert's gradient equals the sum of EP=1's over the EP group (the
    dispatcher brings every EP rank's tokens to it);
  - PP=2 with IndexShare (layers F F F S S S F): split 6+1 (stage 2 starts on layer 6, "full")
    runs megatron's pipeline schedule forward-only and forward+backward and gives PP=1's logits,
    loss and layer gradients; split 4+3 (stage 2 would start on layer 4, "shared") raises
    ValueError at build on every rank, before any weight is loaded;
  - TP=2, EP=2 and PP=2 models built from the HF folder hold the right shards and export back
    (`export_hf_weights` on every rank) bit-exact to the source safetensors, every tensor.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import zlib
from functools import partial

import pytest
import torch

SEQ = 32  # divisible by the TP size (sequence parallel splits the sequence)
STEPS = 10
TP, EP, PP = 2, 2, 2
GOOD_SPLIT, BAD_SPLIT = (6, 1), (4, 3)
GOOD_LAYOUT = "Et*6|tmL"  # the same split as a megatron pipeline layout (MTP with the loss)
TINY_TYPES = ["full", "full", "full", "shared", "shared", "shared", "full"]

# fp32. On CPU the parallel runs agree with the references to ~1e-6 (docs/parallel.md); on GPUs the
# bounds are the 1e-3 for the loss and 1e-4 elsewhere (other reduction orders, atomics).
_CPU = not torch.cuda.is_available()
LOSS_TOL = 1e-5 if _CPU else 1e-3   # per-step loss
GRAD_TOL = 1e-5 if _CPU else 1e-4   # max abs, gradients
LOGITS_TOL = 1e-5 if _CPU else 1e-4  # max abs, logits


# --- helpers run on every rank -------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _ids(seed: int, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(_device())


def _forward(model, ids):
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, -1)
    return model(input_ids=ids, position_ids=positions, attention_mask=None)


def _loss(logits, ids):
    """Mean next-token cross entropy with megatron's vocab-parallel CE: right at any TP size."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits[:, :-1].transpose(0, 1).float().contiguous()  # [s-1, b, V/TP]
    return vocab_parallel_cross_entropy(logits, ids[:, 1:].transpose(0, 1).contiguous()).mean()


def _gather_vocab(logits):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.detach().float().cpu()


def _build(path, **overrides):
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()
    from glm5_bridge.model.bridge import build_megatron_model

    return build_megatron_model(path, **overrides)


def _done():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _export(bridge, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in bridge.export_hf_weights([model], cpu=True, show_progress=False)}


def _full_shape(linear) -> tuple[int, int]:
    return linear.output_size, linear.input_size


def _tp_shard(full: torch.Tensor, local_shape) -> torch.Tensor:
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    for dim in (0, 1):
        if full.shape[dim] != local_shape[dim]:
            return full.chunk(full.shape[dim] // local_shape[dim], dim=dim)[rank]
    return full


def _tp_unshard(local: torch.Tensor, full_shape) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    for dim in (0, 1):
        if local.shape[dim] != full_shape[dim]:
            parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, local.contiguous(), group=group)
            return torch.cat(parts, dim=dim).cpu()
    return local.detach().clone().cpu()


def _set_lora_weights(model, scale=0.05):
    """Every adapter weight non-zero, from its name and full shape only: the same LoRA at any TP."""
    from glm5_bridge.train.lora import lora_parameters

    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = scale * torch.randn(_full_shape(model.get_submodule(name.rsplit(".", 1)[0])), generator=g)
            p.copy_(_tp_shard(full, p.shape).to(p.device))


# --- TP = 2 + sequence parallel, LoRA training ---------------------------------------------------


def _lora_training(path, tp):
    from glm5_bridge.train.lora import GLM5LoRA, lora_parameters

    t0 = time.perf_counter()
    bridge, model = _build(path, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    t_build = time.perf_counter() - t0
    out = {"config": dict(tp=model.config.tensor_model_parallel_size, sp=model.config.sequence_parallel)}
    if tp > 1:
        q_b = model.decoder.layers[0].self_attention.linear_q_up_proj.weight
        out["q_b_shard"] = q_b.detach().cpu().clone()
        t0 = time.perf_counter()
        out["export"] = _export(bridge, model)
        out["export_s"] = time.perf_counter() - t0
    model = GLM5LoRA(dim=4, alpha=8)(model)
    _set_lora_weights(model)
    params = lora_parameters(model)
    shapes = {n: _full_shape(model.get_submodule(n.rsplit(".", 1)[0])) for n in params}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.0)
    losses, grads = [], []
    t0 = time.perf_counter()
    for step in range(STEPS):
        ids = _ids(seed=1000 + step)  # the same batch on every rank and at every TP size
        optimizer.zero_grad()
        loss = _loss(_forward(model, ids), ids)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: _tp_unshard(p.grad, shapes[n]) for n, p in params.items() if p.grad is not None})
        optimizer.step()
    out.update(losses=losses, grads=grads, build_s=t_build, train_s=time.perf_counter() - t0,
               final={n: _tp_unshard(p.detach(), shapes[n]) for n, p in params.items()})
    _done()
    return out


def tp_case(rank, world_size, path):
    return {"tp1": _lora_training(path, 1), f"tp{TP}": _lora_training(path, TP)}


def check_tp_training(results):
    ref = results[0]["tp1"]
    kv_b = sorted(n for n in ref["grads"][0] if "linear_kv_up_proj" in n)
    assert len(kv_b) == 2 * 8, kv_b  # A and B of 7 decoder layers + the MTP layer
    assert len(ref["grads"][0]) == 2 * 5 * 8  # every MLA projection of every layer gets a gradient
    assert ref["losses"][-1] < ref["losses"][0] - 0.1, ref["losses"]  # the adapters train
    worst_loss = worst_grad = worst_kv_b = worst_final = 0.0
    for rank, result in enumerate(results):
        # every rank ran the same TP=1 reference
        assert max(abs(a - b) for a, b in zip(result["tp1"]["losses"], ref["losses"])) <= LOSS_TOL
        tp = result[f"tp{TP}"]
        assert tp["config"] == dict(tp=TP, sp=True)
        diffs = [abs(a - b) for a, b in zip(tp["losses"], ref["losses"])]
        assert len(diffs) == STEPS and max(diffs) <= LOSS_TOL, (rank, diffs)
        worst_loss = max(worst_loss, max(diffs))
        for step, (g, g_ref) in enumerate(zip(tp["grads"], ref["grads"])):
            assert sorted(g) == sorted(g_ref), step
            for name in kv_b:
                assert g_ref[name].abs().max() > 1e-4, (step, name)  # non-zero A and B gradients
            for name in g_ref:
                d = (g[name] - g_ref[name]).abs().max().item()
                assert d <= GRAD_TOL, (rank, step, name, d)
                worst_grad = max(worst_grad, d)
                if name in kv_b:
                    worst_kv_b = max(worst_kv_b, d)
        worst_final = max(worst_final, max((tp["final"][n] - ref["final"][n]).abs().max().item() for n in ref["final"]))
    assert worst_final <= 1e-3  # Adam's normalisation magnifies ~1e-7 gradient differences on tiny entries
    per_step = [f"{abs(a - b):.1e}" for a, b in zip(results[0][f"tp{TP}"]["losses"], ref["losses"])]
    print(f"\nRESULT tp{TP}+sp lora: {STEPS} steps, loss {ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f}; "
          f"per-step |loss diff| (rank 0) {per_step}, max over ranks {worst_loss:.1e}; "
          f"max |grad diff| all adapters {worst_grad:.2e}, kv_b A/B {worst_kv_b:.2e}; final weights {worst_final:.2e}; "
          f"train {ref['train_s']:.1f}s (tp1) {results[0][f'tp{TP}']['train_s']:.1f}s (tp{TP})")


def check_conversion(results, key, source, shard_check):
    """Every rank's export equals the source safetensors bit for bit; `shard_check` looks at the
    rank's own shard of one tensor."""
    for rank, result in enumerate(results):
        exported = result[key]["export"]
        assert sorted(exported) == sorted(source), (rank, set(exported) ^ set(source))
        bad = [k for k in source if exported[k].dtype != source[k].dtype or not torch.equal(exported[k], source[k])]
        assert not bad, (rank, bad[:5])
        shard_check(rank, result[key])
    print(f"\nRESULT {key} export: {len(source)}/{len(source)} tensors bit-exact on each of {len(results)} ranks, "
          f"{results[0][key]['export_s']:.2f}s")


def check_tp_conversion(results, source):
    def shard(rank, result):  # q_b_proj is column-parallel: rank r holds row block r
        q_b = source["model.layers.0.self_attn.q_b_proj.weight"]
        assert torch.equal(result["q_b_shard"], q_b.chunk(TP, dim=0)[rank % TP])

    check_conversion(results, f"tp{TP}", source, shard)


# --- EP = 2 ----------------------------------------------------------------------------------------


_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _moe_pass(path, ep, rank):
    from megatron.core import parallel_state

    bridge, model = _build(path, expert_model_parallel_size=ep)
    out = {"dispatcher": model.config.moe_token_dispatcher_type}
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    n_local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    out["ep_group"] = torch.distributed.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())
    layer1 = model.decoder.layers[1].mlp.experts.local_experts
    out["n_local"] = len(layer1)
    out["expert0_fc2"] = layer1[0].linear_fc2.weight.detach().cpu().clone()
    out["ep_rank"] = ep_rank
    if ep > 1:
        t0 = time.perf_counter()
        out["export"] = _export(bridge, model)
        out["export_s"] = time.perf_counter() - t0
    ids = _ids(seed=2000 + rank)  # different tokens on every rank, as in data parallel training
    logits = _forward(model, ids)
    loss = _loss(logits, ids)
    loss.backward()

    def global_name(name):  # local expert i of EP rank r is expert r * n_local + i
        return _LOCAL_EXPERT.sub(lambda m: f"local_experts.{ep_rank * n_local + int(m.group(1))}.", name)

    out.update(logits=_gather_vocab(logits), loss=loss.item(),
               grads={global_name(n): p.grad.detach().cpu().clone()
                      for n, p in model.named_parameters() if p.grad is not None})
    _done()
    return out


def ep_case(rank, world_size, path):
    return {"ep1": _moe_pass(path, 1, rank), f"ep{EP}": _moe_pass(path, EP, rank)}


def check_ep(results):
    worst_logits = worst_loss = worst_grad = worst_expert = 0.0
    n_expert_grads = 0
    for rank, result in enumerate(results):
        ref, ep = result["ep1"], result[f"ep{EP}"]
        if not torch.cuda.is_available():
            assert ep["dispatcher"] == "allgather"
        assert ref["n_local"] == 8 and ep["n_local"] == 8 // EP and len(ep["ep_group"]) == EP
        d = (ep["logits"] - ref["logits"]).abs().max().item()
        assert d <= LOGITS_TOL, (rank, d)
        worst_logits = max(worst_logits, d)
        worst_loss = max(worst_loss, abs(ep["loss"] - ref["loss"]))
        assert abs(ep["loss"] - ref["loss"]) <= LOSS_TOL
        experts = [n for n in ep["grads"] if "local_experts" in n]
        assert len(experts) == 2 * (8 // EP) * 7  # fc1 + fc2 of this rank's experts, 6 MoE layers + MTP
        for name, g in ep["grads"].items():
            if "local_experts" in name:  # expert weights see every EP rank's tokens routed to them
                g_ref = sum(results[q]["ep1"]["grads"][name] for q in ep["ep_group"])
                d = (g - g_ref).abs().max().item()
                worst_expert = max(worst_expert, d)
                n_expert_grads += 1
            else:
                g_ref = ref["grads"][name]
                d = (g - g_ref).abs().max().item()
                worst_grad = max(worst_grad, d)
            assert d <= GRAD_TOL, (rank, name, d)
        non_expert = {n for n in ref["grads"] if "local_experts" not in n}
        assert non_expert == {n for n in ep["grads"] if "local_experts" not in n}
    for result in results:  # each EP group together holds the 8 experts of a layer, once each
        held = [int(_LOCAL_EXPERT.search(n).group(1)) for q in result[f"ep{EP}"]["ep_group"]
                for n in results[q][f"ep{EP}"]["grads"] if n.startswith("decoder.layers.1.mlp.experts.")
                and n.endswith("linear_fc1.weight")]
        assert sorted(held) == list(range(8)), held
    print(f"\nRESULT ep{EP}: max |logits diff| {worst_logits:.2e}, |loss diff| {worst_loss:.2e}, "
          f"max |grad diff| non-expert {worst_grad:.2e}, experts (vs EP-group sum of EP=1) {worst_expert:.2e} "
          f"over {n_expert_grads} expert tensors")


def check_ep_conversion(results, source):
    def shard(rank, result):  # rank r holds experts r*4 .. r*4+3 of every MoE layer
        expert = result["ep_rank"] * (8 // EP)
        assert torch.equal(result["expert0_fc2"], source[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"])

    check_conversion(results, f"ep{EP}", source, shard)


# --- PP = 2 with IndexShare ------------------------------------------------------------------------


def _pipeline_step(model, ids, forward_only):
    """One micro-batch through megatron's schedule for this PP size; (logits, loss) on the last
    stage, (None, None) elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = {}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = _forward(chunk, batch)

        def loss_func(logits):
            loss = _loss(logits, batch)
            captured.update(logits=_gather_vocab(logits), loss=loss.item())
            return loss, {"loss": loss.detach()}

        return output, loss_func

    b, s = ids.shape
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=[model],
                                num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=forward_only)
    return captured.get("logits"), captured.get("loss")


def _pipeline_pass(path, split):
    overrides = {}
    if split:
        overrides = dict(pipeline_model_parallel_size=PP, num_layers_in_first_pipeline_stage=split[0],
                         num_layers_in_last_pipeline_stage=split[1])
    bridge, model = _build(path, **overrides)
    layers = model.decoder.layers
    offset = layers[0].layer_number - 1
    out = {"layers": [l.layer_number - 1 for l in layers],
           "has_indexer": [l.self_attention.core_attention.indexer is not None for l in layers],
           "mtp": getattr(model, "mtp", None) is not None}
    if split:
        t0 = time.perf_counter()
        out["export"] = _export(bridge, model)
        out["export_s"] = time.perf_counter() - t0
    ids = _ids(seed=3000)  # the same batch on every rank
    model.eval()
    with torch.no_grad():
        out["eval_logits"], out["eval_loss"] = _pipeline_step(model, ids, forward_only=True)
    model.train()
    out["train_logits"], out["train_loss"] = _pipeline_step(model, ids, forward_only=False)
    out["grads"] = {re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{offset + int(m.group(1))}.", n):
                    p.grad.detach().cpu().clone()
                    for n, p in model.named_parameters() if p.grad is not None and n.startswith("decoder.layers.")}
    _done()
    return out


def pp_case(rank, world_size, path):
    out = {"pp1": _pipeline_pass(path, None), f"pp{PP}": _pipeline_pass(path, GOOD_SPLIT)}
    _, model = _build(path, load_weights=False, pipeline_model_parallel_size=PP,
                      pipeline_model_parallel_layout=GOOD_LAYOUT)
    out["layout_layers"] = [l.layer_number - 1 for l in model.decoder.layers]
    _done()
    # A boundary on a shared layer: rejected while the spec is built, on every rank.
    t0 = time.perf_counter()
    try:
        _build(path, pipeline_model_parallel_size=PP, num_layers_in_first_pipeline_stage=BAD_SPLIT[0],
               num_layers_in_last_pipeline_stage=BAD_SPLIT[1])
        out["bad_split"] = None
    except Exception as e:  # noqa: BLE001  (the type is checked by check_pp_rejects_shared_boundary)
        import traceback

        out["bad_split"] = dict(type=type(e).__name__, message=str(e), seconds=time.perf_counter() - t0,
                                frames=[(os.path.basename(f.filename), f.name)
                                        for f in traceback.extract_tb(e.__traceback__)])
    finally:
        _done()
    return out


def check_pp(results):
    worst_eval = worst_train = worst_grad = 0.0
    stages = {}
    for rank, result in enumerate(results):
        ref, pp = result["pp1"], result[f"pp{PP}"]
        assert ref["layers"] == list(range(7))
        stage = 0 if pp["layers"][0] == 0 else 1
        stages[stage] = pp["layers"]
        assert pp["layers"] == ([0, 1, 2, 3, 4, 5] if stage == 0 else [6])
        assert pp["has_indexer"] == [TINY_TYPES[i] == "full" for i in pp["layers"]]
        assert pp["mtp"] == (stage == 1)  # the MTP layer sits with the output layer
        assert result["layout_layers"] == pp["layers"]  # GOOD_LAYOUT builds the same stages
        if stage == 1:
            for kind in ("eval", "train"):
                d = (pp[f"{kind}_logits"] - ref[f"{kind}_logits"]).abs().max().item()
                assert d <= LOGITS_TOL, (rank, kind, d)
                assert abs(pp[f"{kind}_loss"] - ref[f"{kind}_loss"]) <= LOSS_TOL
                if kind == "eval":
                    worst_eval = max(worst_eval, d)
                else:
                    worst_train = max(worst_train, d)
        else:
            assert pp["eval_logits"] is None and pp["train_logits"] is None
        # this stage's layer gradients (through the pipeline's backward send for stage 0)
        own = {n for n in ref["grads"] if int(n.split(".")[2]) in pp["layers"]}
        assert set(pp["grads"]) == own and own, rank
        for name in own:
            d = (pp["grads"][name] - ref["grads"][name]).abs().max().item()
            assert d <= GRAD_TOL, (rank, name, d)
            worst_grad = max(worst_grad, d)
        assert any(ref["grads"][n].abs().max() > 1e-4 for n in own)
    assert sorted(stages) == [0, 1]
    print(f"\nRESULT pp{PP} split {GOOD_SPLIT[0]}+{GOOD_SPLIT[1]}: max |logits diff| eval {worst_eval:.2e} "
          f"train {worst_train:.2e}; max |layer grad diff| {worst_grad:.2e}")


def check_pp_rejects_shared_boundary(results):
    for rank, result in enumerate(results):
        bad = result["bad_split"]
        assert bad is not None, f"rank {rank} built a pipeline whose stage 2 starts on a shared layer"
        assert bad["type"] == "ValueError", bad
        assert bad["message"].startswith("pipeline stage starts at layer 4, an IndexShare 'shared' layer"), bad
        assert "[0, 1, 2, 6]" in bad["message"], bad  # where stages may start
        # raised by our block spec, which megatron-bridge's provide() asks for before constructing
        # GPTModel: no module built, no weight loaded, nothing run
        frames = [tuple(f) for f in bad["frames"]]
        assert frames[-2:] == [("spec.py", "glm5_block_spec"), ("config.py", "check_stage_starts")], frames
        assert ("gpt_provider.py", "provide") in frames and not any(f == "gpt_model.py" for f, _ in frames), frames
    print(f"\nRESULT pp{PP} split {BAD_SPLIT[0]}+{BAD_SPLIT[1]}: ValueError on all {len(results)} ranks in "
          f"{max(r['bad_split']['seconds'] for r in results):.2f}s: {results[0]['bad_split']['message']}")


def check_pp_conversion(results, source):
    check_conversion(results, f"pp{PP}", source, lambda rank, result: None)


# --- running the cases -------------------------------------------------------------------------------

CASES = {"tp": tp_case, "ep": ep_case, "pp": pp_case}


def run_cases(rank, world_size, path, names=tuple(CASES)):
    """Each case in turn on this rank → {name: ("ok", value, seconds) or ("error", traceback, seconds)}:
    a case that raises on every rank does not stop the next (one that raises on some ranks only
    leaves the others waiting in a collective, as any distributed program would)."""
    import traceback

    if not torch.cuda.is_available():  # one rank's threads per core share: no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    out = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            out[name] = ("ok", CASES[name](rank, world_size, path), time.perf_counter() - t0)
        except Exception:  # noqa: BLE001  (reported by the test of that case)
            out[name] = ("error", traceback.format_exc(), time.perf_counter() - t0)
            _done()
    return out


def case_results(per_rank: list[dict], name: str) -> list:
    """One case's values in rank order; raises with the first failing rank's traceback."""
    for rank, result in enumerate(per_rank):
        status, value, _ = result[name]
        if status != "ok":
            raise AssertionError(f"{name} case failed on rank {rank}:\n{value}")
    return [result[name][1] for result in per_rank]


# --- pytest (CPU, gloo) ----------------------------------------------------------------------------

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(),
                               reason="with CUDA, run scripts/multi_gpu.sh (torchrun + NCCL) instead")


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    from safetensors.torch import load_file

    return load_file(tiny_checkpoint("GLM-5.2") / "model.safetensors")


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint):
    """Every case on 2 gloo processes, in one spawn (the imports dominate a spawn's time)."""
    from glm5_bridge.distributed import run_local_ranks

    t0 = time.perf_counter()
    per_rank = run_local_ranks(run_cases, 2, str(tiny_checkpoint("GLM-5.2")))
    print(f"\n2 gloo ranks, {time.perf_counter() - t0:.1f}s: "
          + ", ".join(f"{name} {per_rank[0][name][2]:.1f}s" for name in CASES))
    return per_rank


@needs_cpu
@pytest.mark.slow
def test_tp2_sequence_parallel_lora_training_matches_tp1(ranks):
    check_tp_training(case_results(ranks, "tp"))


@needs_cpu
@pytest.mark.slow
def test_tp2_conversion_is_bit_exact(ranks, source):
    check_tp_conversion(case_results(ranks, "tp"), source)


@needs_cpu
@pytest.mark.slow
def test_ep2_matches_ep1(ranks):
    check_ep(case_results(ranks, "ep"))


@needs_cpu
@pytest.mark.slow
def test_ep2_conversion_is_bit_exact(ranks, source):
    check_ep_conversion(case_results(ranks, "ep"), source)


@needs_cpu
@pytest.mark.slow
def test_pp2_stage_on_a_full_layer_matches_pp1(ranks):
    check_pp(case_results(ranks, "pp"))


@needs_cpu
@pytest.mark.slow
def test_pp2_stage_on_a_shared_layer_is_rejected_at_build(ranks):
    check_pp_rejects_shared_boundary(case_results(ranks, "pp"))


@needs_cpu
@pytest.mark.slow
def test_pp2_conversion_is_bit_exact(ranks, source):
    check_pp_conversion(case_results(ranks, "pp"), source)


def test_pipeline_stage_starts_from_the_config(tiny_checkpoint):
    """The stage starts every rank checks (spec.py), for the split fields, a layout and virtual
    stages, without a process group."""
    from glm5_bridge.model.bridge import AutoBridge
    from glm5_bridge.model.spec import pipeline_stage_starts

    def starts(**fields):
        bridge = AutoBridge.from_hf_pretrained(str(tiny_checkpoint("GLM-5.2")))
        provider = bridge.to_megatron_provider(load_weights=False)
        for key, value in fields.items():
            setattr(provider, key, value)
        provider.finalize()
        return pipeline_stage_starts(provider)

    assert starts() == [0]
    assert starts(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=6,
                  num_layers_in_last_pipeline_stage=1) == [0, 6]
    assert starts(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=4,
                  num_layers_in_last_pipeline_stage=3) == [0, 4]
    assert starts(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=GOOD_LAYOUT) == [0, 6]
    assert starts(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*3|t*4mL") == [0, 3]
    assert starts(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t*2|t*3|tmL") == [0, 1, 3, 6]


# --- torchrun (GPUs with NCCL, or gloo on CPU) ------------------------------------------------------


def main() -> int:
    """`torchrun --nproc-per-node N tests/test_parallel.py`: every case and check above, with NCCL
    and one GPU per rank when CUDA is available. Exit status 0 when every check passes."""
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()
    from safetensors.torch import load_file

    from glm5_bridge.testing import make_tiny_checkpoint

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    holder = [None]
    if rank == 0:
        folder = os.path.join(tempfile.mkdtemp(prefix="glm5_parallel_"), "tiny")
        holder[0] = str(make_tiny_checkpoint("GLM-5.2", folder))
    torch.distributed.broadcast_object_list(holder, src=0)
    path = holder[0]
    source = load_file(os.path.join(path, "model.safetensors"))
    if cuda:  # fp32 means fp32 (no TF32 matmuls)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    checks = {"tp": [check_tp_training, partial(check_tp_conversion, source=source)],
              "ep": [check_ep, partial(check_ep_conversion, source=source)],
              "pp": [check_pp, check_pp_rejects_shared_boundary, partial(check_pp_conversion, source=source)]}
    failed = 0
    for name in CASES:
        value = run_cases(rank, world, path, names=(name,))
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object(value, gathered, dst=0)
        if rank == 0:
            print(f"{name} case: {world} ranks ({'nccl' if cuda else 'gloo'}), {value[name][2]:.1f}s", flush=True)
            for check in checks[name]:
                check_name = getattr(check, "func", check).__name__
                try:
                    check(case_results(gathered, name))
                    print("PASS", check_name, flush=True)
                except AssertionError as e:
                    failed += 1
                    print("FAIL", check_name, str(e)[:4000], flush=True)
    status = torch.tensor([failed], device=_device())
    torch.distributed.broadcast(status, src=0)
    torch.distributed.destroy_process_group()
    if rank == 0:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return int(status.item() != 0)


if __name__ == "__main__":
    sys.exit(main())
