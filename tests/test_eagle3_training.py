"""`pdspec train-eagle3` end to end on the embedded model: distillation records what training
needs, training resumes from its checkpoint, and the exported head drafts losslessly."""

import json
from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import load_weights
from engine.params import SamplingParams
from tools.eagle3_training.distill import check_distilled, distill
from tools.eagle3_training.features import TargetFeatures
from tools.eagle3_training.run_dir import held
from tools.eagle3_training import trainer
from tools.eagle3_training.shards import answer_token_counts, load_shard, repeated_samples, shard_paths
from tools.eagle3_training.trainer import TargetDistribution, TrainConfig, _head_shape, collate, train

QUESTIONS = ["Name three primary colors.", "Count from 1 to 10.", "What is 12 times 12?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-eagle3")
    distill(QUESTIONS, out / "data", None, max_new_tokens=16, batch_size=4)
    return out


def test_distilled_last_layer_output_reproduces_the_targets_greedy_choices(run_dir, engine):
    """Soft labels come from the stored last-layer output: its argmax must be the next token the
    target actually chose (fp16 storage may flip a near-tie, hardly more)."""
    shard = load_shard(next((run_dir / "data").glob("shard-*.safetensors")))
    config = engine.runner.model_config
    assert shard["features"].shape[1] == 3 * config.hidden_size
    assert shard["final_hidden"].shape[1] == config.hidden_size
    weights = load_weights(engine.runner.model_dir, torch.float32, torch.device("cpu"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    teacher = TargetDistribution(weights["model.norm.weight"], head, config.rms_norm_eps)
    agree, total = 0, 0
    for i in range(len(QUESTIONS)):
        start, end = int(shard["offsets"][i]), int(shard["offsets"][i + 1])
        answer_from = start + int(shard["prompt_lens"][i]) - 1  # the prompt's last position picks token 1
        predicted = teacher.probs(shard["final_hidden"][answer_from : end - 1]).argmax(-1)
        agree += int((predicted == shard["tokens"][answer_from + 1 : end].long()).sum())
        total += end - 1 - answer_from
    assert total >= len(QUESTIONS) and agree >= 0.95 * total


def test_training_resumes_and_exports_a_head_that_drafts_losslessly(run_dir, engine, caplog):
    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=run_dir, draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=2, batch_tokens=256, warmup_steps=1, snapshot_tokens=(1, 10**12))
    train(cfg)
    first = json.loads((run_dir / "training.json").read_text())
    assert first["step"] > 0 and first["samples"] == len(QUESTIONS)
    assert first["finished"] and first["total_steps"] == first["step"]
    snapshot = run_dir / "snapshots" / "1e-06M"  # taken after the first step, the only size reached
    taken = json.loads((snapshot / "progress.json").read_text())
    assert taken["step"] == 1 and (snapshot / "model.safetensors").exists()
    assert 0 < taken["answer_tokens"] < taken["tokens"]  # sizes count answers, not the prompts before them
    assert [p.name for p in (run_dir / "snapshots").iterdir()] == ["1e-06M"]
    # A size past the answers the run trains on is said at its start (a recipe asked for 16M of 10.9M).
    assert any("no snapshot at 1e+06M answer tokens" in r.getMessage() for r in caplog.records)
    train(replace(cfg, epochs=2.0))  # resumes at the checkpoint's step
    second = json.loads((run_dir / "training.json").read_text())
    assert second["step"] == 2 * first["step"] and second["tokens"] == 2 * first["tokens"]
    assert json.loads((snapshot / "progress.json").read_text()) == taken  # kept, not overwritten

    spec = Engine(EngineConfig(num_kv_blocks=128, speculative={"method": "eagle3", "model": str(run_dir),
                                                               "num_speculative_tokens": 3}))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    params = SamplingParams(max_tokens=24)
    plain = [t for o in engine.generate(prompt, params) for t in o.token_ids]
    outs = list(spec.generate(prompt, params))
    assert [t for o in outs for t in o.token_ids] == plain
    assert outs[-1].acceptance.drafted > 0


def test_max_hours_is_each_runs_own_budget(run_dir, tmp_path, monkeypatch):
    """A run resumed after earlier ones trains for its own --max-hours, however long they ran."""
    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=tmp_path, draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=2, batch_tokens=256, warmup_steps=1)
    train(cfg)
    first = json.loads((tmp_path / "training.json").read_text())["step"]
    checkpoint = tmp_path / "checkpoints" / "latest.pt"
    state = torch.load(checkpoint, weights_only=False)
    state["progress"]["seconds"] = 10 * 3600.0  # as if earlier runs had trained for ten hours
    torch.save(state, checkpoint)
    train(replace(cfg, epochs=2.0, max_hours=1.0))
    assert json.loads((tmp_path / "training.json").read_text())["step"] == 2 * first
    loaded = []
    monkeypatch.setattr(trainer, "load_shard", lambda path: loaded.append(path) or load_shard(path))
    train(replace(cfg, epochs=3.0, max_hours=1e-9))  # out of time before a step
    assert not loaded  # nor does it read the shards left before its checkpoint
    cut = json.loads((tmp_path / "training.json").read_text())
    assert cut["step"] == 2 * first and not cut["finished"] and cut["total_steps"] == 3 * first
    with pytest.raises(ValueError, match="started on other data or settings \\(batch_tokens differ\\)"):
        train(replace(cfg, epochs=3.0, batch_tokens=512))  # its steps would index other batches
    # Another loss or learning rate mid-run (the CLI's defaults where the recipe's flags were left out)
    with pytest.raises(ValueError, match="started with ttt_steps 2 \\(now 3\\), lr 0.0005 \\(now 0.001\\)"):
        train(replace(cfg, epochs=3.0, ttt_steps=3, lr=1e-3))


def test_an_export_cut_short_leaves_the_last_one(run_dir, tmp_path, monkeypatch):
    """Each session's end exports into the run's directory: a kill mid-write left a cut
    model.safetensors beside its config."""
    from safetensors.torch import load_file, save_file

    from tools.eagle3_training import model as head_model

    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=tmp_path, draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=1, batch_tokens=256, warmup_steps=1)
    train(cfg)
    before = load_file(tmp_path / "model.safetensors")

    def cut(tensors, path):
        save_file(tensors, path)
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(head_model, "save_file", cut)
    with pytest.raises(KeyboardInterrupt):
        train(replace(cfg, epochs=2.0))
    after = load_file(tmp_path / "model.safetensors")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_sample_distilled_twice_is_trained_on_once(run_dir, tmp_path):
    """Corpus part 2 asks part 1's prompts again, and greedy decoding answers them alike: a second
    copy must not weigh them twice."""
    (tmp_path / "data").mkdir()
    for shard in shard_paths(run_dir / "data"):
        for copy in (shard.name, shard.name.replace("shard-", "shard-copy-")):
            (tmp_path / "data" / copy).symlink_to(shard)
    train(TrainConfig(target=None, data_dir=tmp_path / "data", out_dir=tmp_path, draft_vocab_size=1024, epochs=1.0,
                      ttt_steps=1, batch_tokens=256, warmup_steps=1))
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["samples"] == len(QUESTIONS) == report["repeated_samples_skipped"]
    # Nor in the draft vocabulary's counts (one shard in two copies: every count was doubled).
    once, twice = (answer_token_counts(repeated_samples(shard_paths(d)), 49152) for d in (run_dir / "data", tmp_path / "data"))
    assert once.sum() > 0 and torch.equal(once, twice)


def test_training_refuses_a_distillation_cut_short(run_dir, tmp_path):
    from deploy.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS + ["One more question."]))
    (tmp_path / "data").symlink_to(run_dir / "data")  # answers to the first four only
    assert main(["train-eagle3", "--prompts", str(prompts), "--out", str(tmp_path), "--stage", "train"]) == 2
    assert not (tmp_path / "checkpoints").exists()


def test_teacher_forced_accuracy_counts_every_answer_position(run_dir):
    """bench.draft_accuracy on the shipped head: one draft position-1 prediction per answer token,
    every one in a calibration bin, and a wider top-k never less accurate at position 1."""
    from bench.draft_accuracy import load_head, measure
    from engine.runner import EMBEDDED_DRAFT_DIR

    result = measure(load_head(EMBEDDED_DRAFT_DIR, None), run_dir / "data")
    answer_tokens = 0
    for path in shard_paths(run_dir / "data"):
        shard = load_shard(path)
        answer_tokens += int((shard["offsets"][1:] - shard["offsets"][:-1] - shard["prompt_lens"]).sum())
    assert result["positions"] == answer_tokens
    assert sum(row["positions"] for row in result["calibration"]) == answer_tokens
    top_k = list(result["top_k_position_1"].values())
    assert top_k == sorted(top_k) and 0 < top_k[-1] <= 1
    assert all(0 <= rate <= 1 for rate in result["top_k_position_2_given_1"].values())


def test_tokens_only_shards_recompute_the_stored_features(run_dir, tmp_path):
    """Distilled without features, the same answers; the target recomputes, in one forward over
    several samples, exactly the fp16 features and last-layer outputs the decode steps stored."""
    distill(QUESTIONS, tmp_path / "data", None, max_new_tokens=16, batch_size=4, store_features=False)
    stored = load_shard(next((run_dir / "data").glob("shard-*.safetensors")))
    tokens_only = load_shard(next((tmp_path / "data").glob("shard-*.safetensors")))
    assert set(tokens_only) == {"tokens", "offsets", "prompt_lens"}
    for key in tokens_only:
        assert torch.equal(tokens_only[key], stored[key])
    indices = list(range(len(QUESTIONS)))
    with pytest.raises(ValueError, match="recompute"):
        collate(tokens_only, indices, max_len=512)
    recomputed = collate(tokens_only, indices, max_len=512, target_features=TargetFeatures(None, 512))
    for got, want in zip(recomputed, collate(stored, indices, max_len=512)):
        assert torch.equal(got, want)
    # and training on either gives the same head
    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=tmp_path / "stored", draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=2, batch_tokens=256, warmup_steps=1)
    heads = [load_weights(train(c), torch.float32, torch.device("cpu"))
             for c in (cfg, replace(cfg, data_dir=tmp_path / "data", out_dir=tmp_path / "recomputed"))]
    assert heads[0].keys() == heads[1].keys()
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_recomputed_features_do_not_depend_on_how_many_samples_share_the_pool():
    """Seventy two-token samples need more whole blocks than a 16-token batch's pool holds: they
    are computed in groups that fit, each sample as it would be alone."""
    features = TargetFeatures(None, 16)
    samples = [[100 + i, 200 + i] for i in range(70)]
    together = features(samples)
    assert len(together) == 70
    for i in (0, 35, 69):
        alone = features([samples[i]])[0]
        assert all(torch.equal(a, b) for a, b in zip(together[i], alone))


def test_a_conversation_is_answered_turn_by_turn_after_the_targets_own_answers(engine, tmp_path):
    """A prompt given as turns: one sample per answer; the second's prompt is the conversation as a
    chat client would send it (the first answer as text), and its answer is the target's greedy one.
    An answer cut at max_new_tokens ends its conversation: sent back as a whole turn, it would be
    history the target never wrote."""
    turns = [QUESTIONS[0], "Now name three secondary colors."]  # the first answer ends in 22 tokens
    cut = ["Write a long story about a dragon.", "Now make it shorter."]  # cut at 32
    distill([turns, cut, QUESTIONS[2]], tmp_path / "data", None, max_new_tokens=32, batch_size=4, store_features=False)
    shard = load_shard(next((tmp_path / "data").glob("shard-*.safetensors")))
    samples = [shard["tokens"][a:b].tolist() for a, b in zip(shard["offsets"][:-1], shard["offsets"][1:])]
    assert len(samples) == 4 and json.loads((tmp_path / "data" / "done.json").read_text()) == [0, 1, 2]
    dragon = engine.tokenizer.encode_chat([{"role": "user", "content": cut[0]}])
    assert sum(s[: len(dragon)] == dragon for s in samples) == 1  # its first answer only
    params = SamplingParams(max_tokens=32)
    first = engine.tokenizer.encode_chat([{"role": "user", "content": turns[0]}])
    answer = [t for o in engine.generate(first, params) for t in o.token_ids]
    assert first + answer in samples
    second = engine.tokenizer.encode_chat([{"role": "user", "content": turns[0]},
                                           {"role": "assistant", "content": engine.tokenizer.decode(answer, True)},
                                           {"role": "user", "content": turns[1]}])
    (i,) = [i for i, s in enumerate(samples) if s[: len(second)] == second]
    assert shard["prompt_lens"][i] == len(second)
    assert samples[i][len(second):] == [t for o in engine.generate(second, params) for t in o.token_ids]


def test_a_resumed_or_continued_head_keeps_its_shape(tmp_path):
    """Resuming a run or continuing a head may leave --draft-intermediate-size and --draft-layers
    out (their values are kept) but not change them."""
    state = {"model": {"up_proj.weight": torch.zeros(1280, 8), "input_layernorm": torch.ones(8)}}
    init = {"midlayer.mlp.up_proj.weight": torch.zeros(2560, 8), "layers.1.input_layernorm.weight": torch.ones(8)}
    cfg = TrainConfig(target=None, data_dir=tmp_path, out_dir=tmp_path)
    assert _head_shape(cfg, None, None) == (None, 1)
    assert _head_shape(replace(cfg, intermediate_size=2048, num_layers=3), None, None) == (2048, 3)
    assert _head_shape(cfg, state, None) == (1280, 1) == _head_shape(replace(cfg, intermediate_size=1280), state, init)
    assert _head_shape(cfg, None, init) == (2560, 2)
    with pytest.raises(ValueError, match="started with 1280"):
        _head_shape(replace(cfg, intermediate_size=1536), state, None)
    with pytest.raises(ValueError, match="--draft-layers 1: the head to continue from .* has 2"):
        _head_shape(replace(cfg, num_layers=1), None, init)


def test_a_head_reading_other_layers_trains_on_them_and_drafts_from_them_losslessly(run_dir, engine, tmp_path):
    """--aux-layers: the features are recomputed from those layers (the shards hold the default's),
    the export names them, a resumed run keeps them, and the engine feeds the head from them; the
    last layer's output (id 30) is the row of the teacher's logits."""
    from bench.draft_accuracy import load_head, measure

    layers = (4, 12, 30)
    features, final_hidden = TargetFeatures(None, 64, layers)([engine.tokenizer.encode(QUESTIONS[0])])[0]
    assert torch.equal(features[:-1, -final_hidden.shape[1]:], final_hidden[:-1])
    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=tmp_path, draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=2, batch_tokens=256, warmup_steps=1, aux_layer_ids=layers)
    train(cfg)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": list(layers)}
    with pytest.raises(ValueError, match=r"--aux-layers 2 15 27: the run in .* was started with 4 12 30"):
        train(replace(cfg, epochs=2.0, aux_layer_ids=(2, 15, 27)))
    assert measure(load_head(tmp_path, None), run_dir / "data")["positions"] > 0

    spec = Engine(EngineConfig(num_kv_blocks=128, speculative={"method": "eagle3", "model": str(tmp_path),
                                                               "num_speculative_tokens": 3, "adaptive": False}))
    assert spec.runner.model.aux_layer_ids == layers
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
    params = SamplingParams(max_tokens=24)
    outs = list(spec.generate(prompt, params))
    assert [t for o in outs for t in o.token_ids] == [t for o in engine.generate(prompt, params) for t in o.token_ids]
    assert outs[-1].acceptance.drafted > 0


@pytest.mark.parametrize("layers", [[2, 15, 31], [15, 2, 27], [2, 15], [-1, 15, 27]])
def test_the_engine_refuses_a_head_naming_layers_the_target_lacks(tmp_path, layers):
    from engine.config import ModelConfigError
    from engine.runner import EMBEDDED_DRAFT_DIR

    (tmp_path / "model.safetensors").symlink_to(EMBEDDED_DRAFT_DIR / "model.safetensors")
    config = json.loads((EMBEDDED_DRAFT_DIR / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"auxiliary layers .*three rising layer ids in 0\.\.30"):
        Engine(EngineConfig(num_kv_blocks=64, speculative={"method": "eagle3", "model": str(tmp_path)}))


def test_a_shard_written_before_its_run_recorded_it_is_not_distilled_again(tmp_path):
    """Killed between writing a shard and updating done.json, a run finds the shard's own record of
    its conversations: resumed, it does not answer them again into a second copy, and the
    distillation counts as finished."""
    data = tmp_path / "data"
    distill(QUESTIONS[:2], data, None, max_new_tokens=8, batch_size=4, store_features=False)
    (data / "done.json").write_text("[]")  # as if killed right after the shard's rename
    distill(QUESTIONS[:2], data, None, max_new_tokens=8, batch_size=4, store_features=False)
    assert len(shard_paths(data)) == 1
    check_distilled(data, 2)  # not "finish the distillation first", forever


def test_a_run_cut_before_its_first_done_json_is_not_taken_for_finished(tmp_path):
    """Killed after its first shard's rename and before done.json was first written, a distillation
    was taken as data made elsewhere, whole: a head trained on it fixed its vocabulary and schedule
    from part of the prompts."""
    data = tmp_path / "data"
    distill(QUESTIONS[:2], data, None, max_new_tokens=8, batch_size=1, shard_size=1, store_features=False)
    (data / "done.json").unlink()
    shard_paths(data)[-1].unlink()
    with pytest.raises(ValueError, match="holds answers to 1 of the 2 prompts"):
        check_distilled(data, 2)


def test_one_run_at_a_time_works_in_a_directory(tmp_path):
    with held(tmp_path / "data"), pytest.raises(RuntimeError, match="another process is distilling or training"):
        distill(QUESTIONS[:1], tmp_path / "data", None, max_new_tokens=8, batch_size=4, store_features=False)
    assert not list((tmp_path / "data").glob("shard-*"))


def test_a_run_from_before_1024_token_samples_resumes_with_its_own_settings(run_dir, tmp_path):
    """Its checkpoint's batching fixed the steps done: it resumes at 512-token samples (not refused
    for a default it never asked for), and without snapshots (it counted no answer tokens)."""
    cfg = TrainConfig(target=None, data_dir=run_dir / "data", out_dir=tmp_path, draft_vocab_size=1024,
                      epochs=1.0, ttt_steps=1, batch_tokens=256, warmup_steps=1)
    train(cfg)
    checkpoint = tmp_path / "checkpoints" / "latest.pt"
    state = torch.load(checkpoint, weights_only=False)
    state["data"]["max_len"] = 512
    del state["progress"]["answer_tokens"]
    torch.save(state, checkpoint)
    train(replace(cfg, epochs=2.0, snapshot_tokens=(1,)))
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["config"]["max_len"] == "512" and report["finished"]
    assert not (tmp_path / "snapshots").exists()
