"""Replay payloads exactly as sglang sends them (glm5_bridge/model/payload.py), on tiny GLM-5.2, CPU.

The payloads come from tests/_sglang_like.py: a transformers model run the way sglang serves and
captures (one prefill batch, batched decode, KV-slot indexed capture buffers, one indexer slot per
decoder layer with IndexShare copies, every layer's routed experts), whose indexers score in bf16 and
whose routers choose with a shifted correction bias — so its selections differ from the fp32
trainer's. Its log-probs are transformers' under exactly those keys and experts: with both replayed,
the trainer must reproduce them.
"""

import json
import re

import pytest
import torch
from _sglang_like import SglangLike, rollout_rows

from glm5_bridge.model.payload import ReplayLayout, RequestTopk, decode_routed_experts, encode_int32, encode_routed_experts

PROMPTS = (5, 14, 9, 21)  # uneven; 14 and 21 are above index_topk = 8
NEW_TOKENS = (12, 6, 9, 5)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("GLM-5.2")  # 7 decoder layers: computing 0, 1, 2, 6; shared 3–5 (source 2)


@pytest.fixture(scope="module")
def layout(path):
    from glm5_bridge.model.config import load_hf_config

    return ReplayLayout.from_hf_config(load_hf_config(path))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in PROMPTS]


def _engine(path, shift=0.05):
    from glm5_bridge.testing import load_hf

    return SglangLike(load_hf(path), router_bias_shift=shift)


@pytest.fixture(scope="module")
def responses(path, prompts):
    """Miles' build (positions, layer count sent) and the same run without the layer count."""
    engine = _engine(path)
    return {field: engine.generate(prompts, list(NEW_TOKENS), num_layers_field=field) for field in (True, False)}


def _write(tmp_path, rows, name="rollouts.jsonl"):
    out = tmp_path / name
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _lengths(prompts):
    return [p + n for p, n in zip(PROMPTS, NEW_TOKENS)]


def test_decode_every_layer_form_and_encode_it_back(layout, prompts, responses):
    """Both sglang forms decode to the computing layers' slots; the compact computing-only form too;
    encoding gives back sglang's exact bytes and layer count."""
    assert layout.computing == [0, 1, 2, 6] and layout.sources == [0, 1, 2, 2, 2, 2, 6]
    for r, n in enumerate(_lengths(prompts)):
        metas = [responses[True][r]["meta_info"], responses[False][r]["meta_info"]]
        assert metas[0]["indexer_topk_num_layers"] == 7 and "indexer_topk_num_layers" not in metas[1]
        with_field, without = (RequestTopk.from_sglang(m, layout, n) for m in metas)
        assert with_field.shape == (n - 1, 4, 8)
        assert torch.equal(with_field.tensor(), without.tensor())
        every = torch.frombuffer(bytearray(__import__("base64").b64decode(metas[1]["indexer_topk"])),
                                 dtype=torch.int32).view(n - 1, 7, 8)
        assert torch.equal(with_field.tensor(), every[:, [0, 1, 2, 6]])
        assert (every[:, 3:6] == every[:, 2:3]).all()  # the engine's shared slots are copies
        assert ((every >= 0).sum(-1)[:, 0] == torch.arange(1, n).clamp(max=8)).all()  # −1 padded short rows
        compact = {"indexer_topk": encode_int32(with_field.tensor())}
        assert torch.equal(RequestTopk.from_sglang(compact, layout, n).tensor(), with_field.tensor())
        assert with_field.to_sglang(layout) == {k: metas[0][k] for k in ("indexer_topk", "indexer_topk_num_layers")}
        experts = decode_routed_experts(metas[0], layout, n)
        assert experts.shape == (n - 1, 6, 2)
        assert encode_routed_experts(experts, layout) == metas[0]["routed_experts"]


def test_replayed_keys_and_experts_reproduce_the_engine(path, layout, prompts, responses, tmp_path):
    """train↔rollout |Δlogprob| on the response tokens: fp32 noise with both replayed; the engine's
    own selections differ from the trainer's, so without replay (or with the indexer alone) not."""
    from glm5_bridge.testing import load_megatron
    from glm5_bridge.train.rl import load_rollouts, policy_logprobs, rollout_batch

    rows = rollout_rows(prompts, responses[True][:2] + responses[False][2:], [1.0, 0.0, 1.0, 0.0])
    samples = load_rollouts(_write(tmp_path, rows), 256, layout)
    _, model = load_megatron(path, moe_enable_routing_replay=True)
    model.eval()
    batch = rollout_batch(samples, model.vocab_size)
    mask = batch.loss_mask[0]

    def gap(replay, experts=True):
        batch.routes = [s.routes for s in samples] if experts else None
        with torch.no_grad():
            return ((policy_logprobs(model, batch, replay) - batch.rollout_logprobs[0]).abs() * mask).max().item()

    assert gap(True) < 1e-4
    assert gap(False) > 1e-2
    assert gap(True, experts=False) > 1e-2  # the shifted routers chose other experts
    # the same rollouts streamed into a compact replay store, replayed a layer at a time from it
    streamed = load_rollouts(tmp_path / "rollouts.jsonl", 256, layout, store=tmp_path / "replay" / "r.r3")
    assert all(s.topk._read_layer is not None for s in streamed)
    batch = rollout_batch(streamed, model.vocab_size)
    assert gap(True) < 1e-4


def test_rl_step_replays_engine_payloads(path, prompts, responses, tmp_path):
    """The RL trainer on the engine's rollout file: at LoRA init the policy is the engine's model, so
    with replay the ratio is 1 and the gap fp32 noise; without replay the gap shows."""
    from glm5_bridge.train.recipe import load_recipe
    from glm5_bridge.train.rl import train_rl

    data = _write(tmp_path, rollout_rows(prompts, responses[False], [1.0, 0.0, 1.0, 0.0]))
    first = {}
    for name, flags in (("on", ["rl.replay=true"]), ("indexer", ["rl.replay=true", "rl.replay_routes=false"]),
                        ("off", ["rl.replay=false"])):
        recipe = load_recipe(None, ["task=rl", f"model.checkpoint={path}", f"train.output_dir={tmp_path / name}",
                                    f"data.train={data}", "data.max_tokens=256", "train.steps=1", "lora.dim=4",
                                    "export.kind=none", "train.deterministic=true", *flags])
        first[name] = train_rl(recipe)["history"][0]
    assert first["on"]["replay"] and first["on"]["routing_replay"]
    assert first["on"]["logprob_abs_diff_max"] < 1e-4 and abs(first["on"]["ratio_mean"] - 1) < 1e-5
    assert first["off"]["logprob_abs_diff_max"] > 1e-2
    # rl.replay_routes=false: the top-k replayed, the routers left to choose
    assert first["indexer"]["replay"] and not first["indexer"]["routing_replay"]
    # rl.replay_store: the payloads streamed into {output_dir}/replay/ and replayed from there
    recipe = load_recipe(None, ["task=rl", f"model.checkpoint={path}", f"train.output_dir={tmp_path / 'store'}",
                                f"data.train={data}", "data.max_tokens=256", "train.steps=1", "lora.dim=4",
                                "export.kind=none", "train.deterministic=true", "rl.replay_store=true"])
    stored = train_rl(recipe)["history"][0]
    assert (tmp_path / "store" / "replay" / "rollouts.jsonl.rank0.r3").is_file()
    assert stored["replay"] and stored["logprob_abs_diff_max"] < 1e-4 and abs(stored["ratio_mean"] - 1) < 1e-5


def test_routed_experts_start_len(path, layout, prompts, tmp_path):
    """Rows begin at `routed_experts_start_len`: earlier rows come back −1 and the router chooses them
    itself (an engine with the trainer's routing, so the gap stays fp32 noise only if the rows line up)."""
    from glm5_bridge.testing import load_megatron
    from glm5_bridge.train.rl import load_rollouts, policy_logprobs, rollout_batch

    starts = [3, 0, 9, 20]
    engine = _engine(path, shift=0.0)
    full = engine.generate(prompts, list(NEW_TOKENS))
    engine = _engine(path, shift=0.0)
    trimmed = engine.generate(prompts, list(NEW_TOKENS), routed_start=starts)
    for r, (n, start) in enumerate(zip(_lengths(prompts), starts)):
        whole = decode_routed_experts(full[r]["meta_info"], layout, n)
        part = decode_routed_experts(trimmed[r]["meta_info"], layout, n)
        assert (part[:start] == -1).all() and torch.equal(part[start:], whole[start:])

    samples = load_rollouts(_write(tmp_path, rollout_rows(prompts, trimmed, [0.0] * 4)), 256, layout)
    _, model = load_megatron(path, moe_enable_routing_replay=True)
    model.eval()
    batch = rollout_batch(samples, model.vocab_size)
    with torch.no_grad():
        plain = policy_logprobs(model, batch, replay=False)
        batch.replay = None  # experts alone, all −1: exactly the router's own choice
        batch.routes = [torch.full_like(s.routes, -1) for s in samples]
        assert torch.equal(policy_logprobs(model, batch, replay=True), plain)
        batch.replay, batch.routes = [s.topk for s in samples], [s.routes for s in samples]
        replayed = policy_logprobs(model, batch, replay=True)
    assert ((replayed - batch.rollout_logprobs[0]).abs() * batch.loss_mask[0]).max() < 1e-4


# --- refused payloads: one line naming the request and the layer ------------------------------------

def _meta_with(meta, key, edit):
    import base64

    raw = torch.frombuffer(bytearray(base64.b64decode(meta[key])), dtype=torch.int32).clone()
    return {**meta, key: encode_int32(edit(raw))}


def _load_error(tmp_path, layout, prompts, responses, r, meta):
    from glm5_bridge.train.rl import load_rollouts

    rows = rollout_rows(prompts, responses, [0.0] * 4)
    rows[r]["meta_info"] = meta
    data = _write(tmp_path, rows)
    with pytest.raises(ValueError) as err:
        load_rollouts(data, 256, layout)
    message = str(err.value)
    assert "\n" not in message and f"request '{data}:{r + 1}'" in message
    return message


def test_kv_cache_coordinates_refused(path, layout, prompts, tmp_path):
    release = _engine(path).generate(prompts, list(NEW_TOKENS), positions=False, num_layers_field=False)
    message = _load_error(tmp_path, layout, prompts, release, 0, release[0]["meta_info"])
    assert re.search(r"model.layers.0: row \d+ selects key \d+, after its own position \d+: this looks like KV-cache "
                     r"coordinates, not positions\. .*sglang PR 26684", message)


def test_shared_slot_differs_from_its_source(layout, prompts, responses, tmp_path):
    r, n = 1, _lengths(prompts)[1]
    meta = responses[True][r]["meta_info"]

    def edit(raw):
        t = raw.view(n - 1, 7, 8)
        t[9, 4, 0] = (t[9, 4, 0] + 1) % 10  # model.layers.4 (shared, source model.layers.2), row 9
        return t
    bad = _meta_with(meta, "indexer_topk", edit)
    message = _load_error(tmp_path, layout, prompts, responses[True], r, bad)
    assert message.endswith("model.layers.4: row 9 differs from the top-k of model.layers.2, which this IndexShare "
                            "layer reuses (is the payload from a model with another indexer schedule?)")
    with pytest.warns(UserWarning, match=r"model.layers.4: row 9 differs .* replaying the source layer's top-k"):
        warned = RequestTopk.from_sglang(bad, layout, n, shared_mismatch="warn")
    assert torch.equal(warned.tensor(), RequestTopk.from_sglang(meta, layout, n).tensor())


@pytest.mark.parametrize("field", [True, False])
def test_wrong_row_count(layout, prompts, responses, tmp_path, field):
    r, n = 2, _lengths(prompts)[2]
    meta = _meta_with(responses[field][r]["meta_info"], "indexer_topk", lambda raw: raw[: -7 * 8])  # one row short
    message = _load_error(tmp_path, layout, prompts, responses[field], r, meta)
    assert message.endswith(f"indexer_topk holds {(n - 2) * 56} int32, which fits neither 7 decoder layers nor 4 "
                            f"computing layers × (len(tokens) − 1 = {n - 1}) rows × index_topk 8")


def test_layer_count_not_the_models(layout, prompts, responses, tmp_path):
    meta = {**responses[True][0]["meta_info"], "indexer_topk_num_layers": 5}
    message = _load_error(tmp_path, layout, prompts, responses[True], 0, meta)
    assert message.endswith("indexer_topk_num_layers is 5; the model has 7 decoder layers, 4 of them computing top-k")


BAD_EXPERTS = {
    "outside": (lambda t: t.__setitem__((4, 3, 1), 8), "model.layers.3: row 4 routes to expert 8, outside [0, 8)"),
    "negative": (lambda t: t.__setitem__((0, 6, 0), -1), "model.layers.6: row 0 routes to expert -1, outside [0, 8)"),
    "twice": (lambda t: t[7, 2].copy_(torch.tensor([5, 5])), "model.layers.2: row 7 routes to the same expert twice ([5, 5])"),
}


@pytest.mark.parametrize("case", BAD_EXPERTS)
def test_bad_routed_experts(layout, prompts, responses, tmp_path, case):
    r, n = 0, _lengths(prompts)[0]
    edit, expected = BAD_EXPERTS[case]

    def apply(raw):
        t = raw.view(n - 1, 7, 2)
        edit(t)
        return t
    meta = _meta_with(responses[True][r]["meta_info"], "routed_experts", apply)
    assert _load_error(tmp_path, layout, prompts, responses[True], r, meta).endswith(expected)


def test_dense_layer_rows_are_ignored(layout, prompts, responses):
    n = _lengths(prompts)[0]
    meta = responses[True][0]["meta_info"]
    noisy = _meta_with(meta, "routed_experts", lambda raw: raw.view(n - 1, 7, 2).index_fill_(1, torch.tensor([0]), 3))
    assert torch.equal(decode_routed_experts(noisy, layout, n), decode_routed_experts(meta, layout, n))
