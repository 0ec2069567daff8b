"""Rollouts for benchmarks/real_width.py's RL step, written in the rollout-file format of train/rl.py
with sglang's meta_info: transformers generates (bf16 on a GPU, like a rollout engine; fp32 on a CPU)
from long prompts — longer than index_topk, so the indexer's selection matters — with its indexer
top-k and routed experts captured per request (train/colocated.py: IndexerCapture, generate_rollouts),
so that replay in training is R3's: the rollout's keys and the rollout's experts.

The reward is synthetic (a random model answers nothing): a number in [0, 1] drawn from the sampled
tokens, so a group's advantages are not all zero and the policy-gradient step has something to do.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_width import long_chats  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--samples", type=int, default=2, help="samples a prompt (a GRPO group)")
    p.add_argument("--numbers", type=int, default=400, help="numbers in a prompt (~6 tokens each)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from glm5_bridge.hf import load_hf
    from glm5_bridge.process_stats import record_at_exit
    from glm5_bridge.train.colocated import IndexerCapture, generate_rollouts
    from glm5_bridge.train.data import load_tokenizer

    record_at_exit()
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    model = load_hf(args.hf, dtype=dtype).to("cuda" if gpu else "cpu")
    tokenizer = load_tokenizer(args.hf)
    capture = IndexerCapture(model, dtype, routes=True)
    problems = long_chats(args.prompts, seed=1, numbers=(args.numbers, args.numbers))
    rows = generate_rollouts(model, tokenizer, [q for q in problems for _ in range(args.samples)], capture,
                             args.new_tokens, torch.Generator().manual_seed(args.seed))
    with open(args.out, "w") as f:
        for row in rows:
            row["reward"] = (sum(row["tokens"][-args.new_tokens:]) % 101) / 100
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rollouts of {[len(r['tokens']) for r in rows]} tokens → {args.out}")


if __name__ == "__main__":
    main()
