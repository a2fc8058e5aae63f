"""Distillation prompts: the templated tiers never repeat a prompt and keep their order when a tier
is added; model-written questions are taken from quotes and kept away from held-out prompts."""

import json
from pathlib import Path

import pytest

from tools.eagle3_training import model_prompts
from tools.prompts import read_prompts
from tools.eagle3_training.model_prompts import _words, first_question, overlaps
from tools.eagle3_training.synthetic_prompts import synthetic_prompts

HELD_OUT = [_words(p) for f in sorted((Path(__file__).parents[1] / "bench" / "prompts").glob("*.jsonl"))
            for p in read_prompts(f)]


def test_templated_prompts_are_distinct_and_adding_a_tier_kept_the_earlier_ones():
    everything = synthetic_prompts(100_000, seed=4)
    assert len(everything) == len(set(everything)) > 20_000
    assert synthetic_prompts(500, seed=4, skip=7_300) == everything[7_300:7_800]  # across the v5 tier's start
    # What seed 4 gave before the v5 tier existed (heads v2-v4 were distilled from these).
    assert (everything[0], everything[1_399], everything[7_439]) == (
        "What is fractions?", "What are common mistakes people make with the Olympic Games?",
        "Write a haiku about freelancing.")


def test_the_first_quoted_question_is_taken():
    assert first_question('A curious person might ask: "What makes a good potter?" or "Why clay?"') == \
        "What makes a good potter?"
    assert first_question("I'm ready to help. What's your request?") is None  # not quoted
    assert first_question('Here is one: "Tell me about kites."') is None  # not a question


def test_questions_close_to_a_held_out_prompt_are_dropped():
    assert overlaps("How does a refrigerator keep food fresh?", HELD_OUT)  # "Explain how a refrigerator keeps food cold."
    assert overlaps("What is the difference between machine learning and AI?", HELD_OUT)
    assert not overlaps("What is the best way to prepare a homemade lasagna?", HELD_OUT)


def test_an_interrupted_run_goes_on_from_its_progress_file(tmp_path, monkeypatch):
    """The target's questions, asked in batches: stopped after its first batch and run again, a run
    asks only the batches after it, and ends with what an uninterrupted run gives."""
    whole = model_prompts.model_prompts(3, seed=5, batch_size=4)
    asked, answers = [], model_prompts._answers

    def stopping_after_one_batch(engine, asks):
        if asked:
            raise KeyboardInterrupt  # the fault: a run stopped between batches
        asked.append(asks)
        return answers(engine, asks)

    progress = tmp_path / "prompts.jsonl.progress"
    monkeypatch.setattr(model_prompts, "_answers", stopping_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        model_prompts.model_prompts(3, seed=5, batch_size=4, progress_file=progress)
    assert 1 <= len(json.loads(progress.read_text().splitlines()[1])["found"]) < 3  # a find kept, more to come
    with progress.open("a") as f:
        f.write('{"found": ["cut')  # and a line cut by the interruption, as a kill mid-write leaves it
    monkeypatch.setattr(model_prompts, "_answers", lambda engine, asks: asked.append(asks) or answers(engine, asks))
    assert model_prompts.model_prompts(3, seed=5, batch_size=4, progress_file=progress) == whole
    assert len(asked) > 1 and asked[1] != asked[0]  # it went on with the second batch: the first was not asked again
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    assert "header" in rows[0] and all("found" in row for row in rows[1:]) and len(rows) == 1 + len(asked)


def test_a_progress_file_drops_a_cut_line_and_refuses_other_arguments(tmp_path):
    header = {"count": 3, "seed": 5, "batch_size": 4, "target": None, "inputs": "0123"}
    progress = tmp_path / "prompts.jsonl.progress"
    first = json.dumps({"header": header}) + "\n" + json.dumps({"found": ["Why?"]}) + "\n"
    for cut in ('{"found": ["Ho', '{"found": ["How?"]}'):  # the second parses, but its line never ended
        progress.write_text(first + cut)
        assert model_prompts._batches_done(progress, header) == [["Why?"]]
        assert progress.read_text() == first  # the next batch's line goes after the last whole one
    for other in ({"seed": 6}, {"count": 4}, {"inputs": "4567"}):
        with pytest.raises(ValueError, match=f"{next(iter(other))}': {next(iter(other.values()))!r}"):
            model_prompts._batches_done(progress, header | other)
    progress.write_text(json.dumps({"header": header}) + '\n{"fou')  # no batch whole: started again, header first
    assert model_prompts._batches_done(progress, header) == [] and not progress.exists()
