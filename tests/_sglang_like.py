"""A stand-in for sglang's replay capture, on a transformers model, for the payload tests.

It writes `meta_info` the way sglang 0.5.23 assembles it (python/sglang/srt: the capturers keep a
buffer indexed by KV-cache slot; a finished request reads its rows back through its slot table):
- the requests run as one prefill batch, then as batched decode steps (one token per running request
  per step) until each has its own number of new tokens; KV slots come from a shuffled free list (a
  server that has run before) and return to it when a request finishes, so a request's slots are
  neither contiguous nor ordered;
- each forward writes, for every new token, the top-k of EVERY decoder layer into the token's slot
  of the capture buffer (an IndexShare "shared" layer writes the top-k it attended with: its source
  layer's), −1 in unused slots; and every decoder layer's routed experts (dense layers: zeros);
- a finished request's payload is the rows of positions 0 … len(tokens) − 2, in position order,
  from `routed_experts_start_len` on for the experts;
- `positions=True`: key indices are request-local positions (the sglang build miles uses, PR 26684,
  which also sends `indexer_topk_num_layers` unless `num_layers_field=False`); `positions=False`: the
  0.5.23 release's KV-cache coordinates (the key's slot).

The model runs one request at a time (its own prefill, then one token per forward with a KV cache):
the batch schedule decides slot allocation and the order of buffer writes, as in the engine.

Like a real engine it differs from the fp32 trainer in what it selects, not in how it computes: its
indexers score in bf16 (autocast), and its routers choose with a correction bias moved by
`router_bias_shift` (the bias only steers the choice; the weights are the unbiased scores).
"""

from __future__ import annotations

import base64
import random
from contextlib import contextmanager

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


class SglangLike:
    def __init__(self, hf_model, router_bias_shift: float = 0.0, indexer_dtype=torch.bfloat16, seed: int = 0):
        self.model = hf_model
        cfg = hf_model.config
        self.layers = list(hf_model.model.layers)
        self.k, self.moe_topk = cfg.index_topk, cfg.num_experts_per_tok
        self.indexer_dtype = indexer_dtype
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in self.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.add_(router_bias_shift * torch.randn(gate.e_score_correction_bias.shape, generator=g))
        self.rng = random.Random(seed)

    # --- one request through the model: per forward, every layer's top-k and experts of the new tokens
    @contextmanager
    def _capturing(self):
        forward_rows: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        current: dict = {}

        def on_attn(i):
            def hook(_module, _args, out):
                current.setdefault("topk", {})[i] = out[2][0]  # [S, k'] keys this layer attended
            return hook

        def on_gate(i):
            def hook(_module, _args, out):
                current.setdefault("experts", {})[i] = out[2]  # [S, topk]
            return hook

        def low_precision(forward):
            def run(*args, **kwargs):
                with torch.autocast("cpu", dtype=self.indexer_dtype):
                    return forward(*args, **kwargs)
            return run

        handles, originals = [], []
        for i, layer in enumerate(self.layers):
            handles.append(layer.self_attn.register_forward_hook(on_attn(i)))
            if getattr(layer.mlp, "gate", None) is not None:
                handles.append(layer.mlp.gate.register_forward_hook(on_gate(i)))
            if layer.self_attn.indexer is not None:
                originals.append((layer.self_attn.indexer, layer.self_attn.indexer.forward))
                layer.self_attn.indexer.forward = low_precision(layer.self_attn.indexer.forward)

        def end_forward(start: int):
            n = next(iter(current["topk"].values())).shape[0]
            pos = torch.arange(start, start + n)[:, None]
            topk = []
            for i in range(len(self.layers)):
                t = current["topk"][i].to(torch.int32)
                t = torch.where(t > pos, -1, t)  # the reference returns masked keys when fewer are visible
                topk.append(torch.cat([t, torch.full((n, self.k - t.shape[1]), -1, dtype=torch.int32)], 1))
            experts = [current.get("experts", {}).get(i, torch.zeros(n, self.moe_topk, dtype=torch.int64)).to(torch.int32)
                       for i in range(len(self.layers))]
            forward_rows.append((torch.stack(topk, 1), torch.stack(experts, 1)))
            current.clear()

        try:
            yield forward_rows, end_forward
        finally:
            for h in handles:
                h.remove()
            for indexer, forward in originals:
                indexer.forward = forward

    def _run_request(self, prompt: list[int], new_tokens: int, generator: torch.Generator):
        """(completion, logprobs of the completion, per-forward rows)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        completion, logprobs = [], []
        with self._capturing() as (rows, end_forward), torch.no_grad():
            feed, start = prompt, 0
            for _ in range(new_tokens):
                logits = self.model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1]
                end_forward(start)
                logp = torch.log_softmax(logits.float(), -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                completion.append(token)
                logprobs.append(float(logp[token]))
                start += len(feed)
                feed = [token]
        return completion, logprobs, rows

    # --- the engine: batch schedule, KV slots, capture buffers, finished requests' payloads
    def generate(self, prompts: list[list[int]], new_tokens: list[int], positions: bool = True,
                 num_layers_field: bool = True, routed_start: list[int] | None = None, seed: int = 0) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        runs = [self._run_request(p, n, g) for p, n in zip(prompts, new_tokens)]
        pool = sum(len(p) + n for p, n in zip(prompts, new_tokens)) + 7
        free = list(range(pool))
        self.rng.shuffle(free)
        L = len(self.layers)
        topk_buf = torch.full((pool, L, self.k), -1, dtype=torch.int32)
        expert_buf = torch.zeros((pool, L, self.moe_topk), dtype=torch.int32)
        slots: list[list[int]] = [[] for _ in prompts]
        done: dict[int, dict] = {}

        def feed(r: int, forward: int):
            """The request's `forward`-th forward: allocate its new tokens' slots, write their rows."""
            topk, experts = runs[r][2][forward]
            new = [free.pop() for _ in range(topk.shape[0])]
            slots[r] += new
            topk_buf[new], expert_buf[new] = topk, experts

        def finish(r: int):
            n = len(prompts[r]) + new_tokens[r]
            table = torch.tensor(slots[r])
            rows = table[: n - 1]
            topk = topk_buf[rows]
            if not positions:  # the release: key → its KV-cache slot
                topk = torch.where(topk >= 0, table[topk.clamp(min=0).long()], topk)
            start = routed_start[r] if routed_start else 0
            meta = {"indexer_topk": _b64(topk), "routed_experts": _b64(expert_buf[rows[start:]]),
                    "prompt_tokens": len(prompts[r]), "completion_tokens": new_tokens[r]}
            if num_layers_field:
                meta["indexer_topk_num_layers"] = L
            if start:
                meta["routed_experts_start_len"] = start
            completion, logprobs, _ = runs[r]
            done[r] = {"output_ids": completion, "output_token_logprobs": logprobs, "meta_info": meta}
            free.extend(slots[r])

        for r in range(len(prompts)):  # one prefill batch
            feed(r, 0)
        step = 1
        while len(done) < len(prompts):  # batched decode
            for r in range(len(prompts)):
                if r in done:
                    continue
                if step < new_tokens[r]:
                    feed(r, step)
                else:
                    finish(r)
            step += 1
        return [done[r] for r in range(len(prompts))]


def rollout_rows(prompts: list[list[int]], responses: list[dict], rewards: list[float]) -> list[dict]:
    """Rollout-file rows (glm5_bridge/train/rl.py) from the engine's responses."""
    rows = []
    for prompt, resp, reward in zip(prompts, responses, rewards):
        out = resp["output_ids"]
        rows.append({"tokens": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out),
                     "rollout_logprobs": [0.0] * len(prompt) + resp["output_token_logprobs"],
                     "reward": reward, "meta_info": resp["meta_info"]})
    return rows

