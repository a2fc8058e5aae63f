"""Request validation in the router: every malformed request gets a message naming the field."""

import pytest

from engine.tokenizer import Tokenizer
from proto.pdspec.v1 import common_pb2, router_pb2
from router.validation import InvalidRequest, validate

USER = common_pb2.ChatMessage(role="user", content="Hi")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def request(**fields) -> router_pb2.GenerateRequest:
    if not {"messages", "prompt", "token_ids"} & fields.keys():
        fields["prompt"] = "Hello there"
    return router_pb2.GenerateRequest(request_id="r1", **fields)


def sampling(**fields) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(**fields)


@pytest.mark.parametrize("bad, message", [
    (router_pb2.GenerateRequest(), "input: set one of messages, prompt or token_ids"),
    (request(messages=router_pb2.MessageList()), "messages.messages: must be non-empty"),
    (request(prompt=""), "prompt: must be non-empty"),
    (request(token_ids=router_pb2.TokenIds()), "token_ids.ids: must be non-empty"),
    (request(messages=router_pb2.MessageList(messages=[USER, common_pb2.ChatMessage(role="bot", content="x")])),
     "messages.messages[1].role: must be one of system, user, assistant, got 'bot'"),
    (request(token_ids=router_pb2.TokenIds(ids=[1, -5])), "token_ids.ids[1]: must be in [0, "),
    (request(sampling=sampling(max_tokens=0)), "sampling.max_tokens: must be >= 1, got 0"),
    (request(sampling=sampling(temperature=-1)), "sampling.temperature: must be >= 0, got -1"),
    (request(sampling=sampling(temperature=float("inf"))), "sampling.temperature: Input should be a finite number"),
    (request(sampling=sampling(temperature=float("nan"))), "sampling.temperature: Input should be a finite number"),
    (request(sampling=sampling(temperature=2.5)), "sampling.temperature: must be <= 2, got 2.5"),
    (request(sampling=sampling(stop=["END", ""])), "sampling.stop: Value error, an empty stop string would end"),
    (request(sampling=sampling(stop=["s%d" % i for i in range(33)])),
     "sampling.stop: Value error, at most 32 stop strings, got 33"),
    (request(sampling=sampling(stop=["x" * 513])),
     "sampling.stop: Value error, stop strings of at most 512 characters, got one of 513"),
    (router_pb2.GenerateRequest(request_id="r" * 129, prompt="hi"), "request_id: at most 128 characters, got 129"),
    (request(sampling=sampling(top_p=0)), "sampling.top_p: must be > 0, got 0"),
    (request(sampling=sampling(top_p=1.5)), "sampling.top_p: must be <= 1, got 1.5"),
    (request(sampling=sampling(top_k=-1)), "sampling.top_k: must be >= 0, got -1"),
    (request(sampling=sampling(seed=2**63)), "sampling.seed: must be < 9223372036854775808"),
    (request(speculation=common_pb2.SpeculationOptions(num_speculative_tokens=17)),
     "speculation.num_speculative_tokens: must be <= 16, got 17"),
    (request(speculation=common_pb2.SpeculationOptions(num_speculative_tokens=-1)),
     "speculation.num_speculative_tokens: must be >= 0, got -1"),
])
def test_malformed_requests_name_the_field(tokenizer, bad, message):
    with pytest.raises(InvalidRequest) as e:
        validate(bad, tokenizer, max_model_len=2048)
    assert str(e.value).startswith(message), str(e.value)


def test_a_refused_value_is_not_repeated_whole():
    """The message repeated the whole input: 32 stop strings of 512 characters made ~17 KB of gRPC
    status details (past clients' metadata limits: a transport error instead of INVALID_ARGUMENT)."""
    with pytest.raises(InvalidRequest) as e:
        validate(request(sampling=sampling(stop=["x" * 512] * 31 + [""])), None, max_model_len=None)
    assert str(e.value).startswith("sampling.stop: Value error, an empty stop string") and len(str(e.value)) < 300


def test_every_bad_sampling_field_is_reported():
    with pytest.raises(InvalidRequest) as e:
        validate(request(sampling=sampling(temperature=-1, top_k=-2)), None, max_model_len=None)
    assert "sampling.temperature" in str(e.value) and "sampling.top_k" in str(e.value)


def test_prompt_must_be_shorter_than_max_model_len(tokenizer):
    ids = router_pb2.TokenIds(ids=list(range(8)))
    assert validate(request(token_ids=ids), tokenizer, max_model_len=9).prompt_token_ids == list(range(8))
    with pytest.raises(InvalidRequest, match=r"^token_ids.ids: the prompt has 8 tokens; .* max_model_len \(8\)"):
        validate(request(token_ids=ids), tokenizer, max_model_len=8)


def test_valid_requests_are_tokenized_and_forwarded_as_sent(tokenizer):
    chat = validate(request(messages=router_pb2.MessageList(messages=[USER]), sampling=sampling(temperature=0.7)),
                    tokenizer, max_model_len=None)
    assert chat.prompt_token_ids == tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert chat.request_id == "r1" and chat.sampling == sampling(temperature=0.7)
    plain = validate(router_pb2.GenerateRequest(prompt="Hello there"), tokenizer, max_model_len=None)
    assert plain.prompt_token_ids == tokenizer.encode("Hello there") and len(plain.request_id) == 32


def test_a_raw_prompt_gets_the_bos_its_models_tokenizer_adds(model_dir, tmp_path):
    """As HF tokenizers encode text for a model (Llama 3's <|begin_of_text|>); a chat's template
    writes its own, and token ids are taken as they are."""
    import json
    import shutil

    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = {"type": "TemplateProcessing",
                                        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                   {"Sequence": {"id": "A", "type_id": 0}}],
                                        "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                                        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                             "tokens": ["<|endoftext|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with_bos = Tokenizer.from_dir(tmp_path)
    assert validate(request(prompt="Hello there"), with_bos, None).prompt_token_ids[:1] == [0]
    assert validate(request(token_ids=router_pb2.TokenIds(ids=[5, 6])), with_bos, None).prompt_token_ids == [5, 6]
    plain = Tokenizer.from_dir(model_dir)  # the embedded model's adds none
    assert validate(request(prompt="Hello there"), plain, None).prompt_token_ids == plain.encode("Hello there")
