"""Self-distillation data: the target answers each prompt greedily; every position's token, the
target's auxiliary hidden states (the EAGLE3 features) and its last layer's output (from which
training recomputes the target's next-token distribution) are stored.

Output: `shard-NNNNN.safetensors` files, each with `tokens` [T] int32 (samples concatenated),
`offsets` [N+1] int64, `prompt_lens` [N] int64, `features` [T, 3H] fp16 and `final_hidden`
[T, H] fp16 (the rows of a sample's last token are zero: the target never ran on it). With
store_features=False only the tokens, offsets and prompt lengths (4 bytes a token instead of
~4.6 KB): training recomputes the rest (features.py).
`done.json` lists the finished prompt indices, and each shard names its own in its metadata
(`conversations`), so an interrupted run resumes where it stopped, even if it was killed between
writing a shard and done.json. Both are flushed to disk before the run goes on.

A prompt may be a conversation: a list of user turns. The target answers the first, then each
next turn after its own previous answers (rendered as text, as a chat client would send them),
and every answer is a sample whose prompt is the whole conversation before it. An answer cut at
max_new_tokens ends its conversation: rendered as a whole turn, the history would hold what the
target never said (a chat client sends back whole answers).
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.conversions import replace_durably, write_text_durably

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.spec.proposer import Proposal, StatelessProposer
from tools.eagle3_training.features import FEATURE_DTYPE, with_last_layer
from tools.eagle3_training.run_dir import held


class FeatureRecorder(StatelessProposer):
    """A proposer that drafts nothing and keeps each finished sequence, with the target's features
    of every committed position when needs_aux (no draft cache: the rest of a proposer's work is
    none)."""

    def __init__(self, needs_aux: bool):
        self.needs_aux = needs_aux
        self.features: dict[str, list[torch.Tensor]] = {}
        self.finished: list[tuple[Sequence, torch.Tensor | None]] = []

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        if any(num_tokens):
            raise AssertionError("FeatureRecorder runs with speculation off")
        return [Proposal([]) for _ in seqs]

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:
        if aux is None:  # tokens only
            return
        parts = self.features.setdefault(seq.seq_id, [])
        if start == 0:  # (re)computed from the start, e.g. after preemption
            parts.clear()
        parts.append(aux.to(FEATURE_DTYPE))

    def release(self, seq: Sequence) -> None:
        if seq.finish_reason is None:  # preempted: recomputed from the start, observed again
            return
        if not self.needs_aux:
            self.finished.append((seq, None))
            return
        features = torch.cat(self.features.pop(seq.seq_id))
        pad = features.new_zeros(len(seq.token_ids) - features.shape[0], features.shape[1])
        self.finished.append((seq, torch.cat([features, pad])))


def check_distilled(out_dir: Path, num_prompts: int) -> None:
    """Raises ValueError when `out_dir` holds a distillation of fewer than `num_prompts` prompts: a
    head trained on it would fix its draft vocabulary and schedule from part of the data. (Data
    with neither done.json nor shards of its own naming their prompts, made elsewhere, is taken as
    it is; a run cut between its first shard and done.json has one that does.)"""
    ours = (out_dir / "done.json").exists() or _own_shards(out_dir)
    done = sum(i < num_prompts for i in _done(out_dir)) if ours else num_prompts
    if done < num_prompts:
        raise ValueError(f"{out_dir} holds answers to {done} of the {num_prompts} prompts: finish the distillation "
                         "first (--stage distill resumes it)")


def distill(prompts: list[str | list[str]], out_dir: Path, target: str | None, max_new_tokens: int = 256,
            batch_size: int = 32, shard_size: int = 256, store_features: bool = True) -> None:
    with held(out_dir):
        _distill(prompts, out_dir, target, max_new_tokens, batch_size, shard_size, store_features)


def _own_shards(out_dir: Path) -> list[Path]:
    """This run's shards (shard-NNNNN; others, e.g. linked ones, not counted)."""
    return sorted(out_dir.glob("shard-[0-9]*.safetensors"))


def _done(out_dir: Path) -> set[int]:
    """The prompts answered in full: done.json's, and those of shards written after it."""
    done_file = out_dir / "done.json"
    done = set(json.loads(done_file.read_text())) if done_file.exists() else set()
    for path in _own_shards(out_dir):
        with safe_open(str(path), framework="pt") as f:
            done.update(json.loads((f.metadata() or {}).get("conversations", "[]")))
    return done


def _distill(prompts: list[str | list[str]], out_dir: Path, target: str | None, max_new_tokens: int,
             batch_size: int, shard_size: int, store_features: bool) -> None:
    done_file = out_dir / "done.json"
    done = _done(out_dir)
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return
    # Features are observed as positions are computed: a prompt served from the prefix cache
    # would have none. Tokens alone may share the chat template's prefix.
    engine = Engine(EngineConfig(model=target, num_kv_blocks=batch_size * 40, max_num_seqs=batch_size,
                                 enable_prefix_caching=not store_features))
    recorder = FeatureRecorder(needs_aux=store_features)
    engine.proposer = recorder
    if store_features:
        with_last_layer(engine)
    params = SamplingParams(max_tokens=max_new_tokens)
    shard = 1 + max((int(p.stem.split("-")[1]) for p in _own_shards(out_dir)), default=-1)
    progress = tqdm(total=len(todo), desc="distilling", unit="prompt")
    waiting = iter(todo)
    asking: dict[int, list[str]] = {}  # conversation -> its user turns not asked yet
    chats: dict[int, list[dict]] = {}  # conversation -> its messages so far
    answered: dict[int, list[tuple[Sequence, torch.Tensor | None]]] = {}  # conversation -> its samples
    complete: list[int] = []  # conversations answered in full, not in a shard yet

    def ask(i: int) -> None:
        chats[i].append({"role": "user", "content": asking[i].pop(0)})
        engine.add_request(engine.tokenizer.encode_chat(chats[i]), params, request_id=f"{i}.{len(chats[i]) // 2}")

    while True:
        # Conversations, not turns, are admitted: each next turn is asked as soon as the one before
        # is answered, and twice the batch is kept in flight, so the batch stays full (a wave of
        # turns idled it at each wave's tail, while its longest answers finished).
        while len(asking) < 2 * batch_size and (i := next(waiting, None)) is not None:
            asking[i], chats[i], answered[i] = [prompts[i]] if isinstance(prompts[i], str) else list(prompts[i]), [], []
            if not asking[i]:
                raise ValueError(f"prompt {i}: a conversation needs at least one user turn")
            ask(i)
        if not asking:
            break
        engine.step()
        for seq, features in recorder.finished:
            i = int(seq.seq_id.split(".")[0])
            answered[i].append((seq, features))
            answer = engine.tokenizer.decode(seq.token_ids[seq.num_prompt_tokens :], skip_special_tokens=True)
            chats[i].append({"role": "assistant", "content": answer})
            if asking[i] and seq.finish_reason == "stop":
                ask(i)
            else:
                del asking[i], chats[i]
                complete.append(i)
        recorder.finished.clear()
        if len(complete) >= shard_size or (complete and not asking):
            samples = [sample for i in complete for sample in answered.pop(i)]
            _write_shard(out_dir / f"shard-{shard:05d}.safetensors", samples, complete,
                         engine.runner.model_config.hidden_size)
            shard += 1
            done.update(complete)
            write_text_durably(done_file, json.dumps(sorted(done)))
            progress.update(len(complete))
            complete = []
    progress.close()


def _write_shard(path: Path, samples: list[tuple[Sequence, torch.Tensor | None]], conversations: list[int],
                 hidden_size: int) -> None:
    lengths = torch.tensor([len(seq.token_ids) for seq, _ in samples])
    tensors = {
        "tokens": torch.tensor([t for seq, _ in samples for t in seq.token_ids], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([seq.num_prompt_tokens for seq, _ in samples]),
    }
    if samples[0][1] is not None:
        recorded = torch.cat([f for _, f in samples])
        tensors |= {"features": recorded[:, :-hidden_size].contiguous(),
                    "final_hidden": recorded[:, -hidden_size:].contiguous()}
    save_file(tensors, str(path.with_suffix(".tmp")), metadata={"conversations": json.dumps(sorted(conversations))})
    replace_durably(path.with_suffix(".tmp"), path)
