"""Self-distillation data: the target answers each prompt greedily; every position's token, the
target's auxiliary hidden states (the EAGLE3 features) and its last layer's output (from which
training recomputes the target's next-token distribution) are stored.

Output: `shard-NNNNN.safetensors` files, each with `tokens` [T] int32 (samples concatenated),
`offsets` [N+1] int64, `prompt_lens` [N] int64, `features` [T, 3H] fp16 and `final_hidden`
[T, H] fp16 (the rows of a sample's last token are zero: the target never ran on it).
`done.json` lists the finished prompt indices, so an interrupted run resumes where it stopped.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.spec.proposer import Proposal


class FeatureRecorder:
    """A proposer that drafts nothing and keeps the target's features of every committed position."""

    needs_aux = True

    def __init__(self):
        self.features: dict[str, list[torch.Tensor]] = {}
        self.finished: list[tuple[Sequence, torch.Tensor]] = []

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        if any(num_tokens):
            raise AssertionError("FeatureRecorder runs with speculation off")
        return [Proposal([]) for _ in seqs]

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        parts = self.features.setdefault(seq.seq_id, [])
        if start == 0:  # (re)computed from the start, e.g. after preemption
            parts.clear()
        parts.append(aux.to(torch.float16))

    def release(self, seq: Sequence) -> None:
        if seq.finish_reason is None:  # preempted: recomputed from the start, observed again
            return
        features = torch.cat(self.features.pop(seq.seq_id))
        pad = features.new_zeros(len(seq.token_ids) - features.shape[0], features.shape[1])
        self.finished.append((seq, torch.cat([features, pad])))


def distill(prompts: list[str], out_dir: Path, target: str | None, max_new_tokens: int = 256,
            batch_size: int = 32, shard_size: int = 256) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    done_file = out_dir / "done.json"
    done = set(json.loads(done_file.read_text())) if done_file.exists() else set()
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return
    engine = Engine(EngineConfig(model=target, num_kv_blocks=batch_size * 40, max_num_seqs=batch_size,
                                 enable_prefix_caching=False))
    recorder = FeatureRecorder()
    engine.proposer = recorder
    model = engine.runner.model
    model.aux_layer_ids = (*model.aux_layer_ids, engine.runner.model_config.num_layers)  # + the last layer's output
    params = SamplingParams(max_tokens=max_new_tokens)
    shard = len(list(out_dir.glob("shard-*.safetensors")))
    progress = tqdm(total=len(todo), desc="distilling", unit="prompt")
    for start in range(0, len(todo), shard_size):
        indices = todo[start : start + shard_size]
        for i in indices:
            engine.add_request(engine.tokenizer.encode_chat([{"role": "user", "content": prompts[i]}]), params,
                               request_id=str(i))
        while engine.has_unfinished():
            engine.step()
            progress.update(len(recorder.finished) - (progress.n - start))
        _write_shard(out_dir / f"shard-{shard:05d}.safetensors", recorder.finished, engine.runner.model_config.hidden_size)
        shard += 1
        done.update(int(seq.seq_id) for seq, _ in recorder.finished)
        recorder.finished.clear()
        done_file.write_text(json.dumps(sorted(done)))
    progress.close()


def _write_shard(path: Path, samples: list[tuple[Sequence, torch.Tensor]], hidden_size: int) -> None:
    lengths = torch.tensor([len(seq.token_ids) for seq, _ in samples])
    recorded = torch.cat([f for _, f in samples])
    save_file({
        "tokens": torch.tensor([t for seq, _ in samples for t in seq.token_ids], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([seq.num_prompt_tokens for seq, _ in samples]),
        "features": recorded[:, :-hidden_size].contiguous(),
        "final_hidden": recorded[:, -hidden_size:].contiguous(),
    }, str(path.with_suffix(".tmp")))
    path.with_suffix(".tmp").rename(path)
