"""Speculative decoding end to end: lossless greedy output, block accounting, degradation when
the pool is short, and sampled speculation that emits plain sampling's tokens (trees and
thresholds: test_speculative_trees.py; verification's rules: test_rejection.py; the governor:
test_governor.py)."""

import pytest
import torch
from pydantic import ValidationError

from engine.batch import SeqChunk
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv_layout import KVLayoutMismatch
from engine.loader import load_weights
from engine.output import KVHandle
from engine.params import SamplingParams
from engine.spec.eagle3_proposer import CATCH_UP
from tools.eagle3_training.model import TrainableEagle3
from engine.stats import AcceptanceStats
from tests.engine_runs import run_requests


@pytest.fixture(scope="module")
def random_head(engine, tmp_path_factory):
    """An untrained EAGLE3 head for the embedded model, in the published layout."""
    torch.manual_seed(1)
    config = engine.runner.model_config
    weights = load_weights(engine.runner.model_dir, torch.float32, torch.device("cpu"), prefix="model.embed")
    vocab = torch.randperm(config.vocab_size)[:4096].sort().values
    path = tmp_path_factory.mktemp("random-eagle3")
    TrainableEagle3(config, vocab, weights["model.embed_tokens.weight"]).export(path)
    return str(path)


@pytest.fixture(scope="module")
def spec_engines(random_head):
    return {
        "eagle3": Engine(EngineConfig(num_kv_blocks=512, speculative={"adaptive": False, "method": "eagle3", "model": random_head,
                                                                    "num_speculative_tokens": 8})),
        "ngram": Engine(EngineConfig(num_kv_blocks=512, speculative={"adaptive": False, "method": "ngram", "num_speculative_tokens": 8})),
    }


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_greedy_is_lossless_for_batches_1_to_8_and_k_1_to_8(spec_engines, spec_prompts, spec_plain_outputs, method):
    engine = spec_engines[method]
    free = engine.blocks.num_free_blocks
    for batch in (1, 3, 8):
        params = [SamplingParams(max_tokens=32, num_speculative_tokens=1 + (i + batch) % 8) for i in range(batch)]
        assert run_requests(engine, spec_prompts[:batch], params) == spec_plain_outputs[:batch]
    assert engine.blocks.num_free_blocks == free and engine.blocks.num_used_blocks == 0


def test_ngram_accepts_drafts_on_copying_text(spec_engines, spec_prompts, spec_plain_outputs):
    engine = spec_engines["ngram"]
    outs = list(engine.generate(spec_prompts[7], SamplingParams(max_tokens=32)))
    assert [t for o in outs for t in o.token_ids] == spec_plain_outputs[7]
    stats = outs[-1].acceptance
    assert stats.accepted > 0 and stats.mean_acceptance_length > 1.0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(spec_engines, spec_prompts, spec_plain_outputs, method,
                                                                  monkeypatch):
    """Drafts accepted after a stop token are not output, and usage counts only what was; nor does
    their KV stay (eagle3: the shipped head): committed, a block they filled was prefix-cached with
    draft entries never corrected, and the request's end writes pending draft KV only up to the
    last kept token (the positions after it have no next token)."""
    engine = spec_engines["ngram"] if method == "ngram" else Engine(EngineConfig(
        num_kv_blocks=256, speculative={"adaptive": False, "method": "eagle3", "num_speculative_tokens": 5}))
    committed: list[int] = []
    commit = engine.blocks.commit
    monkeypatch.setattr(engine.blocks, "commit", lambda seq_id, tokens: (committed.extend(tokens), commit(seq_id, tokens))[1])
    plain = spec_plain_outputs[7]  # copying text: long accepted runs
    for end in range(4, len(plain) - 1):
        if plain[end] in plain[:end]:
            continue  # stop at the first occurrence only
        committed.clear()
        outs = list(engine.generate(spec_prompts[7], SamplingParams(max_tokens=32, stop_token_ids=[plain[end]])))
        assert [t for o in outs for t in o.token_ids] == plain[: end + 1]
        assert outs[-1].finish_reason == "stop" and outs[-1].usage.completion_tokens == end + 1
        # Each verification step output one token of its own and its accepted drafts (the first
        # token came from the prefill): none counted that the output did not take.
        assert outs[-1].acceptance.steps + outs[-1].acceptance.accepted <= end, end
        with_kv = (spec_prompts[7] + plain[: end + 1])[:-1]  # the last token's KV is never computed
        assert len(committed) >= end and with_kv[len(with_kv) - len(committed):] == committed, end


def test_a_stop_string_inside_an_accepted_run_ends_the_tokens_where_plain_decoding_does(engine, spec_engines, spec_prompts):
    """The token completing a stop string is the last one reported and counted, as in plain
    decoding (an accepted run used to report its tokens after it too)."""
    params = lambda stop: SamplingParams(max_tokens=32, stop=[stop])  # noqa: E731
    plain_text = "".join(o.text for o in engine.generate(spec_prompts[7], SamplingParams(max_tokens=32)))
    for stop in {plain_text[at : at + 3] for at in range(6, len(plain_text) - 3, 5)}:
        want = list(engine.generate(spec_prompts[7], params(stop)))
        got = list(spec_engines["ngram"].generate(spec_prompts[7], params(stop)))
        assert [t for o in got for t in o.token_ids] == [t for o in want for t in o.token_ids], stop
        assert "".join(o.text for o in got) == "".join(o.text for o in want)
        assert (got[-1].finish_reason, got[-1].usage.completion_tokens) == (want[-1].finish_reason,
                                                                            want[-1].usage.completion_tokens)
    assert spec_engines["ngram"].counters["accepted_tokens"] > 0


def test_adaptive_speculation_measures_both_ways_and_stays_lossless(spec_prompts, spec_plain_outputs):
    engine = Engine(EngineConfig(num_kv_blocks=256, speculative={"method": "eagle3", "num_speculative_tokens": 5}))
    assert engine.config.speculative.adaptive  # the default
    assert run_requests(engine, spec_prompts[:2], [SamplingParams(max_tokens=32)] * 2) == spec_plain_outputs[:2]
    alone = [run_requests(engine, [p], [SamplingParams(max_tokens=32)])[0] for p in spec_prompts[:2]]
    assert alone == spec_plain_outputs[:2]
    assert set(engine.governor.figures()[1]) == {"draft", "plain"} and engine.counters["draft_tokens"] > 0


def test_the_governor_neither_chooses_nor_measures_where_nothing_may_draft(spec_prompts, spec_plain_outputs):
    """Above disable_by_batch_size drafting is off whatever the governor chooses: it kept "draft"
    figures there that were plain steps, and each of them broke its run of same-mode steps."""
    engine = Engine(EngineConfig(num_kv_blocks=256, speculative={"method": "eagle3", "disable_by_batch_size": 1}))
    assert run_requests(engine, spec_prompts[:2], [SamplingParams(max_tokens=32)] * 2) == spec_plain_outputs[:2]
    assert 2 not in engine.governor.figures() and engine.counters["draft_tokens"] > 0  # drafted once one was left


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_a_low_precision_kv_cache_keeps_speculation_lossless(spec_prompts, kv_cache_dtype):
    """engine.kv_cache_dtype bfloat16 or int8: target and draft caches hold that type (the C
    kernels widen it as they read; writes round bf16 to nearest even, int8 per row with its
    scale), and tree speculation with leaf KV moves (rows moved whole, scales with them)
    reproduces plain decoding over the same cache type token for token."""
    def engine(**spec) -> Engine:
        return Engine(EngineConfig(num_kv_blocks=256, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, speculative=spec))

    plain, tree = engine(), engine(method="eagle3", num_speculative_tokens=6, draft_top_k=4, adaptive=False)
    assert plain.runner.kv_cache.dtype == tree.runner.draft_cache.dtype == getattr(torch, kv_cache_dtype)
    assert plain.runner.layout.dtype == kv_cache_dtype
    params = [SamplingParams(max_tokens=32)] * 4
    expected = run_requests(plain, spec_prompts[:4], params)
    assert run_requests(tree, spec_prompts[:4], params) == expected
    assert tree.counters["accepted_tokens"] > 0 and tree.blocks.num_used_blocks == 0


def test_the_kv_layout_tells_two_eagle3_heads_of_one_shape_apart(engine, spec_engines):
    """Their draft KV differs: a decode worker with another head than its prefill worker's would
    only lose acceptance, silently, so the hand-off's layout check refuses it by name."""
    shipped = Engine(EngineConfig(num_kv_blocks=16, speculative={"method": "eagle3"})).runner.layout
    random = spec_engines["eagle3"].runner.layout
    assert random.draft == shipped.draft and random.draft_model != shipped.draft_model
    assert shipped.draft_model.startswith("SmolLM2-135M-Instruct-eagle3@") and engine.runner.layout.draft_model == ""
    with pytest.raises(KVLayoutMismatch, match="'draft_model' differs"):
        random.check_compatible(shipped)


@pytest.mark.parametrize("spec, message", [({"method": "ngram", "draft_top_k": 2}, "draft_top_k > 1 needs method 'eagle3'"),
                                           ({"method": "eagle3", "draft_top_k": 9}, "draft_top_k")])
def test_bad_draft_top_k_names_the_field(spec, message):
    with pytest.raises(ValidationError, match=message):
        SpeculativeConfig(**spec)


def _reference_draft_cache(reference: Engine, tokens: list[int]) -> list[int]:
    """What one full draft forward writes over every position of `tokens` whose next token is known,
    from the target's features over the same tokens, in blocks a prefill's KV handle pins on
    `reference`: their block table."""
    ref = reference.add_request(tokens, SamplingParams(max_tokens=1), prefill_only=True)
    while reference.has_unfinished():
        reference.step()
    table, runner = reference.blocks.block_table(ref), reference.runner
    aux = runner.forward([SeqChunk(tokens, 0, table, num_logits=0)], return_aux=True).aux_hidden
    runner.forward_draft([SeqChunk(tokens[1:], 0, table, num_logits=0)], runner.draft.project(aux[:len(tokens) - 1]))
    return table


def test_draft_caches_left_behind_catch_up_to_what_one_forward_computes(spec_prompts):
    """Sequences that draft nothing (here: K=0 for the request) get their draft caches brought up
    to date only past CATCH_UP positions, and when they finish, by a call that writes keys and
    values alone, from the target's features gathered over steps (projected for the whole batch
    at once). Each one's full blocks must end up holding what one full draft forward over the same
    tokens writes: they stay in the prefix cache, draft entries included (the partial last block
    is freed unread)."""
    config = EngineConfig(num_kv_blocks=64, speculative={"adaptive": False, "method": "eagle3", "num_speculative_tokens": 5})
    lagging, reference = Engine(config), Engine(config)
    params = SamplingParams(max_tokens=CATCH_UP + 16, num_speculative_tokens=0, ignore_eos=True)
    ids = [lagging.add_request(spec_prompts[i], params) for i in (0, 3)]
    seqs = [lagging.seqs[i] for i in ids]
    tables, release = {}, lagging.proposer.release

    def recording_release(seq):  # the block table, while the blocks are still allocated
        tables[seq.seq_id] = lagging.blocks.block_table(seq.seq_id)
        release(seq)

    lagging.proposer.release = recording_release
    caught_up_midway = False
    while lagging.has_unfinished():
        caught_up_midway |= all(lagging.proposer.pending.get(i, (0,))[0] > len(spec_prompts[0]) + 8 for i in ids)
        lagging.step()
    assert caught_up_midway  # past the prompt, from decode steps' features, before finishing
    assert lagging.counters["draft_tokens"] == 0 and not lagging.proposer.pending
    for rid, seq in zip(ids, seqs):
        # Every position whose next token is known: all but the last (never run through the target).
        tokens = seq.token_ids
        n = len(tokens) - 1
        full = n // config.block_size * config.block_size  # the positions of its full blocks
        table = _reference_draft_cache(reference, tokens)
        assert 0 < full < n  # a partial block left, unwritten
        torch.testing.assert_close(_draft_kv(lagging, tables[rid], full), _draft_kv(reference, table, full),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_short_by_one", [False, True])
def test_above_the_batch_limit_only_prompts_keep_their_draft_entries(engine, spec_prompts, block_short_by_one):
    """Above disable_by_batch_size nothing drafts, and the engine captures the target's features for
    prompts only (kept current for every decoded position, the draft cache cost 4-7 % of a batch-16
    step): the proposer writes what it holds as far as the prompts' full blocks, which the prefix
    cache shares, and then keeps nothing. A sequence left alone below the limit drafts again, and
    the output is plain decoding's. (A prompt one token short of a block's end: its first decoded
    token fills that block, which holds the prompt's draft entries too.)"""
    config = EngineConfig(num_kv_blocks=64, speculative={"adaptive": False, "method": "eagle3", "disable_by_batch_size": 1})
    above, reference = Engine(config), Engine(config)
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=64, ignore_eos=True)]
    size = config.block_size
    prompts = [p[: (len(p) // size - 1) * size + size - 1] if block_short_by_one else p for p in spec_prompts[:2]]
    ids = [above.add_request(p, sp) for p, sp in zip(prompts, params)]
    seqs, out, checked = [above.seqs[i] for i in ids], {i: [] for i in ids}, False
    while above.has_unfinished():
        for o in above.step():
            out[o.request_id].extend(o.token_ids)
        if seqs[0].num_generated == 16:  # both decoding: above the limit
            assert not above.proposer.pending and not above.proposer.unprojected
            for seq in seqs:  # the prompt's positions in blocks full by now (the last is the first token's)
                full = min(seq.num_prompt_tokens, (seq.num_prompt_tokens + 1) // size * size)
                table = _reference_draft_cache(reference, seq.token_ids)
                torch.testing.assert_close(_draft_kv(above, above.blocks.block_table(seq.seq_id), full),
                                           _draft_kv(reference, table, full), atol=1e-4, rtol=1e-4)
            checked = True
    assert checked
    assert [out[i] for i in ids] == run_requests(engine, prompts, params)
    assert above.counters["draft_tokens"] > 0  # the second, alone, drafted again


@pytest.mark.parametrize("chunks", [3, 2])
def test_a_prompts_blocks_hold_their_draft_entries_as_its_chunks_fill_them(spec_prompts, chunks):
    """A block enters the prefix cache when a prompt's chunk fills it: its draft entries must be in
    it then, not at the prompt's last chunk (a request reusing the block meanwhile drafted from
    stale entries, and its hand-off shipped them so to a decode worker's prefix cache). Also where
    the rest of the prompt is one chunk as long as this one (the step took it for the last)."""
    config = EngineConfig(num_kv_blocks=64, long_prefill_token_threshold=16,
                          speculative={"adaptive": False, "method": "eagle3", "num_speculative_tokens": 5})
    chunked, reference = Engine(config), Engine(config)
    prompt = (spec_prompts[0] + spec_prompts[1])[:16 * chunks]  # chunks of 16
    rid = chunked.add_request(prompt, SamplingParams(max_tokens=4))
    chunked.step()
    assert chunked.seqs[rid].num_computed == 16  # one chunk in: block 0 full (and cached), the prompt not
    table = _reference_draft_cache(reference, prompt)
    torch.testing.assert_close(_draft_kv(chunked, chunked.blocks.block_table(rid), 16), _draft_kv(reference, table, 16),
                               atol=1e-4, rtol=1e-4)


def test_a_handed_off_prompt_filling_its_last_block_leaves_that_blocks_draft_entries_written(spec_prompts):
    """The prefill worker's prefix cache keeps a full last block, draft entries too: the last
    position's (whose input is the first token) is written before the hand-off, not left stale
    for a later request reusing the block."""
    config = EngineConfig(num_kv_blocks=64, speculative={"adaptive": False, "method": "eagle3", "num_speculative_tokens": 5})
    prefill, reference = Engine(config), Engine(config)
    prompt = spec_prompts[0][:32]  # two full blocks
    prefill.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True)
    handle = [out for _ in range(4) if prefill.has_unfinished() for out in prefill.step()][-1].handle
    tokens = prompt + [handle.first_token]
    table = _reference_draft_cache(reference, tokens)
    torch.testing.assert_close(_draft_kv(prefill, handle.block_table, 32), _draft_kv(reference, table, 32),
                               atol=1e-4, rtol=1e-4)


def _draft_kv(engine: Engine, block_table: list[int], num_positions: int) -> torch.Tensor:
    """The draft cache's keys and values at a block table's first positions: [positions, 2, heads, dim]."""
    table = torch.tensor(block_table)
    positions = torch.arange(num_positions)
    block_size = engine.config.block_size
    return engine.runner.draft_cache[table[positions // block_size], 0, :, positions % block_size]


def test_per_position_acceptance_covers_every_drafted_position():
    stats = AcceptanceStats()
    stats.record(num_drafted=5, num_accepted=1)
    stats.record(num_drafted=3, num_accepted=0)
    assert stats.to_dict()["per_position_acceptance_rate"] == [0.5, 0.0, 0.0, 0.0, 0.0]
    assert stats.mean_acceptance_length == 1.5


def test_a_prefill_that_is_handed_off_never_drafts():
    """A chunked prefill whose last chunk is one token looks like a decoding sequence to the
    scheduler; a prefill-only request must still stop at its first token, with no draft slots
    reserved and nothing drafted or committed past the prompt (a repeating prompt: ngram would
    draft)."""
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16,
                                 speculative={"adaptive": False, "method": "ngram", "num_speculative_tokens": 8}))
    prompt = [1000, 1001, 1002, 1003] * 8 + [1000]  # chunks of 16, 16, then 1 token
    rid = engine.add_request(prompt, SamplingParams(max_tokens=16), prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outs] == [(rid, "prefilled", 1)]
    assert engine.counters["verify_steps"] == engine.counters["draft_tokens"] == 0
    assert engine.blocks.num_committed(rid) == len(prompt)
    assert engine.release(rid)


def test_a_preempted_sequence_is_released_while_it_still_holds_its_blocks(engine, spec_prompts):
    """The proposer writes what is pending into the draft cache at preemption, as at a finish, so
    both must come while the sequence's blocks are allocated (they may stay in the prefix cache
    and be reused when the sequence is recomputed). 4 answers of 64 tokens need ~22 blocks of 12:
    preemption happens whatever the drafts' acceptance (which differs between CPUs)."""
    params = [SamplingParams(max_tokens=64, ignore_eos=True)] * 4
    expected = [run_requests(engine, [p], params[:1])[0] for p in spec_prompts[:4]]
    tight = Engine(EngineConfig(num_kv_blocks=12, max_num_seqs=4, speculative={"adaptive": False, "method": "eagle3"}))
    released, release = [], tight.proposer.release

    def recording_release(seq):
        released.append((seq.seq_id, tight.blocks.num_committed(seq.seq_id)))  # raises once freed
        release(seq)

    tight.proposer.release = recording_release
    assert run_requests(tight, spec_prompts[:4], params) == expected
    ids = [seq_id for seq_id, _ in released]
    assert len(ids) > len(set(ids)) == 4  # some were released twice: preempted, then finished
    assert all(committed > 0 for _, committed in released)
    assert tight.blocks.num_used_blocks == 0


def test_short_pool_degrades_to_plain_decoding(random_head, spec_prompts, spec_plain_outputs):
    """With barely enough blocks, reservations fail and sequences fall back to K=0, not to errors."""
    tight = Engine(EngineConfig(num_kv_blocks=10, max_num_seqs=4,
                                speculative={"adaptive": False, "method": "eagle3", "model": random_head, "num_speculative_tokens": 8}))
    params = [SamplingParams(max_tokens=32)] * 4
    assert run_requests(tight, spec_prompts[:4], params) == spec_plain_outputs[:4]
    assert tight.blocks.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "eagle3-tree"])
def test_sampled_speculation_emits_exactly_plain_samplings_tokens(engine, spec_engines, spec_prompts, method):
    """Each position's token is the target's draw with that position's uniform, whatever was
    drafted: with the same seeds, speculation (eagle3-tree: the shipped head, trees of its top 4
    tokens a position) samples what plain decoding samples, token for token, batched and alone."""
    spec = spec_engines["ngram"] if method == "ngram" else Engine(EngineConfig(num_kv_blocks=256, speculative={
        "adaptive": False, "method": "eagle3", "num_speculative_tokens": 5, "draft_top_k": 4}))
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=p, seed=seed)
              for seed, (t, k, p) in enumerate([(1.0, 3, 1.0), (0.7, 0, 0.9), (1.0, 0, 1.0), (0.5, 40, 0.95)])]
    chosen = [spec_prompts[7], spec_prompts[0], spec_prompts[7], spec_prompts[2]]  # copying text: long accepted runs
    plain = run_requests(engine, chosen, params)
    assert run_requests(spec, chosen, params) == plain
    assert [run_requests(spec, [p], [sp])[0] for p, sp in zip(chosen, params)] == plain
    assert spec.counters["accepted_tokens"] > 0


def test_a_handed_over_draft_hidden_state_of_another_width_is_refused_not_run(spec_engines, spec_prompts):
    """It would fail the next draft step, and with it every sequence of that step's batch."""
    engine = spec_engines["eagle3"]
    free_before = engine.blocks.num_free_blocks
    _, table = engine.reserve_prefilled("narrow-hidden", spec_prompts[0], SamplingParams(max_tokens=4))
    handle = KVHandle(table, 0, 0, torch.zeros(1, 100), 0, 0.0)
    with pytest.raises(InvalidRequest, match="draft hidden state of shape"):
        engine.admit_prefilled("narrow-hidden", handle)
    assert engine.blocks.num_free_blocks == free_before and not engine.has_unfinished()
