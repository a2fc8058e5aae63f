"""Distilled shards as training reads them: their paths, their tensors and indexes, the samples
that repeat an earlier one (skipped), and the answer tokens the rest hold."""

from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from tqdm import tqdm


def shard_paths(data_dir: Path) -> list[Path]:
    shards = sorted(data_dir.glob("shard-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no distilled shards in {data_dir}; run the distill stage first")
    return shards


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """A shard's tensors; one stored without features (tokens only) has them recomputed in collate."""
    with safe_open(str(path), framework="pt") as f:
        if "features" in f.keys() and "final_hidden" not in f.keys():
            raise ValueError(f"{path} has no final_hidden (an older distill wrote it): distill again into a new --out")
        return {k: f.get_tensor(k) for k in f.keys()}


def has_features(path: Path) -> bool:
    with safe_open(str(path), framework="pt") as f:
        return "features" in f.keys()


def answer_token_counts(repeated: dict[Path, frozenset[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the target's answers that training reads: the samples of
    the shards of `repeated` but those it names (counted, a conversation distilled twice weighed
    twice in the draft vocabulary: a fifth of corpus part 2's answer tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path, skip in tqdm(repeated.items(), desc="counting tokens", unit="shard"):
        with safe_open(str(path), framework="pt") as f:
            tokens, offsets, prompt_lens = f.get_tensor("tokens").long(), f.get_tensor("offsets"), f.get_tensor("prompt_lens")
        for i in range(prompt_lens.numel()):
            if i not in skip:
                counts += torch.bincount(tokens[offsets[i] + prompt_lens[i] : offsets[i + 1]], minlength=vocab_size)
    return counts


def repeated_samples(shards: list[Path]) -> dict[Path, frozenset[int]]:
    """Per shard, the samples whose tokens (prompt and answer) an earlier sample already holds: a
    conversation distilled again (corpus part 2 asks part 1's prompts again, and greedy decoding
    answers them alike) would weigh twice."""
    seen, repeated = set(), {}
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            tokens, offsets = f.get_tensor("tokens").numpy(), f.get_tensor("offsets").tolist()
        mine = set()
        for i in range(len(offsets) - 1):
            key = xxhash.xxh3_128_intdigest(tokens[offsets[i] : offsets[i + 1]].tobytes())
            if key in seen:
                mine.add(i)
            seen.add(key)
        repeated[path] = frozenset(mine)
    return repeated


def answer_tokens(index: dict[str, torch.Tensor], max_len: int, skip: frozenset[int]) -> int:
    """The answer tokens training reads from a shard (`index`: load_index's offsets and prompt_lens): each
    sample cut to max_len, those of `skip` left out."""
    lengths = (index["offsets"][1:] - index["offsets"][:-1]).clamp_max(max_len)
    answers = (lengths - index["prompt_lens"]).clamp_min(0)
    answers[list(skip)] = 0
    return int(answers.sum())


def load_index(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in ("offsets", "prompt_lens")}
