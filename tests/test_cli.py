"""`pdspec generate` as a user runs it: a subprocess on the embedded default model."""

import json
import subprocess
import sys


def _pdspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_reports_the_answer():
    result = _pdspec("generate", "--prompt", "What is the capital of France?", "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["num_generated_tokens"] == len(out["token_ids"]) > 0
    assert out["num_prompt_tokens"] > 10  # the chat template's default system prompt is there


def test_generate_streams_text():
    result = _pdspec("generate", "--prompt", "Say hi.", "--max-tokens", "8", "--seed", "1", "--temperature", "0.7")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_bad_model_path_is_a_clear_error(tmp_path):
    result = _pdspec("generate", "--prompt", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr
