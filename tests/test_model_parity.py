"""Our forward against transformers on the same weights: logits, and greedy continuations."""

import torch

from engine.params import SamplingParams


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_prefill_logits_match_transformers(exact_engine, hf_model, chat_prompts):
    from engine.batch import SeqChunk

    for i, prompt in enumerate(chat_prompts):
        seq_id = f"parity-{i}"
        exact_engine.blocks.allocate(seq_id, prompt)
        try:
            if exact_engine.blocks.num_committed(seq_id):  # prefix cache hit from an earlier test: recompute all
                exact_engine.blocks.free(seq_id)
                exact_engine.blocks.clear_prefix_cache()
                exact_engine.blocks.allocate(seq_id, prompt)
            chunk = SeqChunk(prompt, 0, exact_engine.blocks.block_table(seq_id), num_logits=len(prompt))
            ours = exact_engine.runner.forward([chunk]).logits
        finally:
            exact_engine.blocks.free(seq_id)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert _relative_error(ours, ref) <= 1e-3


def test_greedy_continuation_matches_transformers(exact_engine, hf_model, chat_prompts):
    raw = [exact_engine.tokenizer.encode("The history of the printing press begins"),
           exact_engine.tokenizer.encode("def fibonacci(n):\n")]
    for prompt in chat_prompts + raw:
        ours = [t for out in exact_engine.generate(prompt, SamplingParams(max_tokens=64)) for t in out.token_ids]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                    eos_token_id=list(exact_engine.tokenizer.stop_token_ids), pad_token_id=2)
        assert ours == ref[0, len(prompt):].tolist()
