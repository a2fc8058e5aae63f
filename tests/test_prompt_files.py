"""Prompt files (bench spec, bench serve, train-eagle3 read them): a row of another shape is
refused naming the file and line; it was a traceback, or for a `turns` string a wrong prompt."""

import subprocess
import sys

import pytest

from tools.prompts import read_conversations


@pytest.mark.parametrize("line, message", [
    ('"a prompt"', "expected an object"), ("123", "expected an object"), ('["x"]', "expected an object"),
    ('{"prompt": 5}', "expected an object"), ('{"prompt": null}', "expected an object"),
    ('{"turns": "hello"}', "expected an object"),  # was the prompt "h"
    ('{"turns": []}', "expected an object"),
    ('{"prompt": "a", }', "not JSON \\(Expecting property name enclosed in double quotes at column 17\\)"),
])
def test_a_row_of_another_shape_is_refused_naming_its_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{line}\n')
    with pytest.raises(ValueError, match=f"{path}:3: {message}"):
        read_conversations(path)


def test_good_rows_read_as_prompts_and_conversations(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n{"turns": ["two", "three"]}\n')
    assert read_conversations(path) == ["one", ["two", "three"]]


def test_the_cli_says_a_bad_prompts_file_as_an_error(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"turns": "hello"}\n')
    for prompts in (tmp_path / "bad.jsonl", tmp_path):  # a directory: IsADirectoryError's traceback before
        result = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "serve", "--router", "127.0.0.1:1",
                                 "--prompts", str(prompts), "--num-requests", "1"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "pdspec: error: " in result.stderr and str(prompts) in result.stderr
