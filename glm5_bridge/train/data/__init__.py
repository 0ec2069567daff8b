"""Chat data → packed thd micro-batches with a loss mask, and the embedded arithmetic dataset.

A sample is one JSON line `{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}`. It is tokenized with the checkpoint's chat template;
only assistant turns (and their end-of-turn token) carry loss. Samples are packed end to end into
micro-batches of at most `max_tokens` tokens (thd layout: `cu_seqlens`, positions restart at 0 for
every sample), the format the fused DSA backend needs and the unfused one accepts.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

ARITHMETIC = Path(__file__).with_name("arithmetic.jsonl")


def arithmetic_problems(n: int, seed: int = 0) -> list[dict]:
    """Short word problems with their answer as the assistant turn (the embedded default data)."""
    rng = random.Random(seed)
    forms = [
        ("What is {a} plus {b}?", lambda a, b: a + b),
        ("What is {a} minus {b}?", lambda a, b: a - b),
        ("Tom has {a} apples and gets {b} more. How many apples does he have?", lambda a, b: a + b),
        ("A box holds {a} pens. {b} are taken out. How many are left?", lambda a, b: a - b),
        ("What is {a} times {b}?", lambda a, b: a * b),
    ]
    out = []
    for _ in range(n):
        text, fn = rng.choice(forms)
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        if "minus" in text or "taken" in text:
            a, b = max(a, b), min(a, b)
        if "times" in text:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        out.append({"messages": [{"role": "user", "content": text.format(a=a, b=b)},
                                 {"role": "assistant", "content": str(fn(a, b))}]})
    return out


MAJORITY = Path(__file__).with_name("majority.jsonl")


def majority_problems(n: int, seed: int = 0, exclude: frozenset = frozenset()) -> list[dict]:
    """"More 0s or 1s in 110111011101111?" → "1": 15 random digits, one of them at least 10 times
    (a clear majority). A random tiny base model answers none of these; LoRA on its attention learns
    the rule in the demo's 60 steps, and it carries over to strings never seen in training, which a
    model that only lowered its loss on the training set would not do. `exclude`: questions to skip
    (a held-out set leaves out the training questions)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        digits = [rng.randint(0, 1) for _ in range(15)]
        ones = sum(digits)
        question = f"More 0s or 1s in {''.join(map(str, digits))}?"
        if 5 < ones < 10 or question in exclude:
            continue
        out.append({"messages": [{"role": "user", "content": question},
                                 {"role": "assistant", "content": "1" if ones >= 10 else "0"}]})
    return out


# datasets shipped in the package, by the name a recipe may give (majority.jsonl: majority_problems(1000))
EMBEDDED = {"arithmetic": ARITHMETIC, "majority": MAJORITY}


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a jsonl file; `path` may also name an embedded dataset ("arithmetic")."""
    path = EMBEDDED.get(str(path), Path(path))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return rows


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(checkpoint):
    """The checkpoint's own tokenizer, or one line naming the folder and what is missing (transformers'
    own message runs over several lines and names no folder)."""
    from transformers import AutoTokenizer

    folder = Path(checkpoint)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder}: no tokenizer (tokenizer.json / tokenizer_config.json); training "
                                "tokenizes with the checkpoint's own tokenizer")
    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{folder}: cannot load its tokenizer ({' '.join(str(e).split())[:300]})") from None


def _ids(encoded) -> list[int]:
    """apply_chat_template returns a list or (transformers 5) a BatchEncoding."""
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss_mask): each assistant turn and its end token have mask 1, the rest 0."""
    ids, mask = [], []
    for i, m in enumerate(messages):
        if m.get("role") not in ("user", "assistant", "system"):
            raise ValueError(f"message {i}: role must be user/assistant/system, got {m.get('role')!r}")
        if m["role"] != "assistant":
            continue
        prompt = _ids(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True))
        full = _ids(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
        if full[: len(prompt)] != prompt or len(full) <= len(prompt):
            raise ValueError(f"message {i}: chat template does not extend the prompt; cannot mask the answer")
        mask += [0] * (len(prompt) - len(ids)) + [1] * (len(full) - len(prompt))
        ids = full
    if not ids or not any(mask):
        raise ValueError("sample has no assistant turn to learn from")
    return ids, mask


def packed_seq_params(lengths: list[int], device=None):
    """thd `PackedSeqParams` for sequences of the given lengths packed end to end."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(device) if device is not None else cu
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


@dataclass
class PackedBatch:
    """One thd micro-batch: `input_ids`/`labels`/`loss_mask`/`position_ids` are [1, T]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def packed_seq_params(self, device=None):
        return packed_seq_params(self.lengths, device)

    def to(self, device) -> "PackedBatch":
        """A copy whose tensors (extra ones set by the trainers included) live on `device`."""
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                setattr(moved, name, value.to(device))
        return moved

    def take(self, rows: torch.Tensor) -> "PackedBatch":
        """A copy holding only the tokens at flat indices `rows` of every per-token [1, T] tensor
        (a context-parallel rank's share); `lengths` stay the whole sequences'."""
        part = copy.copy(self)
        for name, value in vars(self).items():
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == self.num_tokens:
                setattr(part, name, value[:, rows.to(value.device)])
        return part


PAD_ID = 0  # the token a padding segment holds (never in the loss)


def _per_token(batch: PackedBatch) -> dict[str, torch.Tensor]:
    """Every [1, T] tensor of the batch (the trainers add their own: rollout log-probs, advantages),
    with `pad_mask` made explicit."""
    rows = {name: value for name, value in vars(batch).items()
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == batch.num_tokens}
    rows["pad_mask"] = pad_mask(batch)
    return rows


def _pad_fill(name: str, value: torch.Tensor, count: int, first_position: int) -> torch.Tensor:
    """[1, count] of what a padding token holds in field `name`: token PAD_ID, positions counting on
    from `first_position`, pad_mask 1, everything else (loss mask, per-token RL fields) 0."""
    if name == "position_ids":
        fill = torch.arange(first_position, first_position + count)
    elif name == "pad_mask":
        fill = torch.ones(count)
    else:
        fill = torch.full((count,), PAD_ID if name in ("input_ids", "labels") else 0)
    return fill.to(value.dtype).unsqueeze(0)


def pad_each_sequence(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Every sequence padded at its end to a multiple of `multiple` tokens (context parallelism
    splits each sequence into equal chunks). The pads come after the sequence's real tokens, which
    never attend to them, and carry loss mask 0: the real tokens compute as before. Marked in
    `pad_mask`; `sequence_pads` holds each sequence's count (per-sample payloads follow it)."""
    extra = [-n % multiple for n in batch.lengths]
    if not any(extra):
        return batch
    source = _per_token(batch)
    pieces = {name: [] for name in source}
    start = 0
    for n, e in zip(batch.lengths, extra):
        for name, value in source.items():
            pieces[name].append(value[:, start:start + n])
            if e:
                pieces[name].append(_pad_fill(name, value, e, n))
        start += n
    out = copy.copy(batch)
    for name, parts in pieces.items():
        setattr(out, name, torch.cat(parts, 1))
    out.lengths = [n + e for n, e in zip(batch.lengths, extra)]
    out.sequence_pads = extra
    return out


def padded(batch: PackedBatch, length: int) -> PackedBatch:
    """The batch with a padding segment appended (its own sequence, loss mask 0) so that it holds
    `length` tokens: tensor-parallel sequence splits and pipeline sends need fixed, divisible lengths.
    Attention never crosses segments, so the real tokens compute exactly as without it."""
    extra = length - batch.num_tokens
    if extra < 0:
        raise ValueError(f"a micro-batch of {batch.num_tokens} tokens does not fit {length}")
    if extra == 0:
        return batch
    out = copy.copy(batch)
    for name, value in _per_token(batch).items():
        setattr(out, name, torch.cat([value, _pad_fill(name, value, extra, 0)], 1))
    out.lengths = [*batch.lengths, extra]
    out.padding_segment = extra
    return out


def pad_mask(batch: PackedBatch) -> torch.Tensor:
    """[1, T] int8: 1 where a token is padding (a padding segment, or context parallel's pads)."""
    mask = getattr(batch, "pad_mask", None)
    return mask if mask is not None else torch.zeros(1, batch.num_tokens, dtype=torch.int8)


def real_tokens(batch: PackedBatch) -> torch.Tensor:
    """The micro-batch's tokens that are not padding (a 0-d float tensor on its device)."""
    return (batch.input_ids.shape[1] - pad_mask(batch).to(batch.input_ids.device).sum()).float()


def mtp_loss_mask(batch: PackedBatch) -> torch.Tensor:
    """[1, T] the loss mask megatron's MTP loss takes (GPTModel's `loss_mask` with no labels): it
    derives labels by rolling the inputs and rolls this mask with them, so the mask belongs to the
    input side — token t's own flag, which is our label-side loss_mask[t − 1] within its sequence
    (0 at a sequence's first token). The MTP layer then learns exactly the tokens the main loss
    does, one further ahead; without it megatron counts every token, prompts and pads included."""
    shifted = torch.zeros_like(batch.loss_mask)
    shifted[:, 1:] = batch.loss_mask[:, :-1]
    return torch.where(batch.position_ids == 0, torch.zeros_like(shifted), shifted)


def pack(samples: list[tuple[list[int], list[int]]], vocab_size: int) -> PackedBatch:
    """Labels are the next token within each sample; a sample's last position has no label."""
    ids, labels, mask, pos = [], [], [], []
    for s_ids, s_mask in samples:
        bad = [t for t in s_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        ids += s_ids
        labels += s_ids[1:] + [0]
        mask += s_mask[1:] + [0]
        pos += list(range(len(s_ids)))
    as_row = lambda x: torch.tensor(x, dtype=torch.long).unsqueeze(0)  # noqa: E731
    return PackedBatch(as_row(ids), as_row(labels), as_row(mask).float(), as_row(pos), [len(s) for s, _ in samples])


def greedy_groups(lengths: list[int], max_tokens: int, what: str = "sample") -> list[list[int]]:
    """Indices of consecutive items grouped greedily so that each group holds ≤ `max_tokens` tokens."""
    groups, current, size = [], [], 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"{what} {i} has {n} tokens, more than data.max_tokens={max_tokens}")
        if current and size + n > max_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return groups + [current] if current else groups


def packed_batches(tokenized: list[tuple[list[int], list[int]]], max_tokens: int, vocab_size: int,
                   seed: int, epoch: int) -> list[PackedBatch]:
    """One epoch: samples shuffled by (seed, epoch), packed greedily up to `max_tokens` each."""
    for i, (ids, _) in enumerate(tokenized):  # name an oversized sample by its place in the file
        if len(ids) > max_tokens:
            raise ValueError(f"sample {i} has {len(ids)} tokens, more than data.max_tokens={max_tokens}")
    order = list(range(len(tokenized)))
    random.Random(seed * 100003 + epoch).shuffle(order)
    groups = greedy_groups([len(tokenized[i][0]) for i in order], max_tokens)
    return [pack([tokenized[order[j]] for j in group], vocab_size) for group in groups]


class GlobalBatches:
    """The run's stream of packed micro-batches — epochs of `epoch(e)` laid end to end — cut into
    global batches of `size` micro-batches: step s takes stream items [s·size, (s+1)·size), whatever
    the layout, and a data-parallel rank takes every dp-th of them. The stream is a function of the
    data seed alone, so a resumed run (any layout) continues exactly where it stopped."""

    def __init__(self, epoch, size: int):
        self.epoch, self.size = epoch, size
        self._cache: dict[int, list] = {}  # the two most recent epochs
        self._lengths: dict[int, int] = {}  # micro-batches per epoch, every epoch seen

    def _epoch(self, e: int) -> list:
        if e not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k == e - 1}
            self._cache[e] = self.epoch(e)
            if not self._cache[e]:
                raise ValueError("an epoch holds no micro-batches")
            self._lengths[e] = len(self._cache[e])
        return self._cache[e]

    def _length(self, e: int) -> int:
        return self._lengths[e] if e in self._lengths else len(self._epoch(e))

    def item(self, index: int):
        e = 0
        while index >= self._length(e):
            index -= self._length(e)
            e += 1
        return self._epoch(e)[index]

    def step(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> list:
        """This DP rank's micro-batches of global batch `step`."""
        if self.size % dp_size:
            raise ValueError(f"train.global_batch_size {self.size} is not divisible by the {dp_size} data-parallel ranks")
        return [self.item(step * self.size + i) for i in range(dp_rank, self.size, dp_size)]
