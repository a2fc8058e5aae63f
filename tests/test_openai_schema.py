"""The OpenAI API's request bodies as the router reads them, without a cluster: OpenAI's
defaults, values that mean "off", fields refused by name, and the Router's refusals renamed."""

import pytest

QUESTION = [{"role": "user", "content": "Name three primary colors."}]


def test_omitted_fields_take_openais_defaults_and_nulls_are_omissions():
    """temperature 1, and a chat answer as long as the context allows, a text completion 16 tokens
    (the gRPC API's defaults are greedy and 256 tokens); null n or stream mean their defaults."""
    from router.openai_schema import UNTIL_CONTEXT_LIMIT, ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=QUESTION, n=None, stream=None).generate_request("r")
    text = CompletionRequest(prompt="Hello").generate_request("r")
    assert (chat.sampling.temperature, chat.sampling.max_tokens) == (1.0, UNTIL_CONTEXT_LIMIT)
    assert (text.sampling.temperature, text.sampling.max_tokens) == (1.0, 16)
    chosen = ChatCompletionRequest(messages=QUESTION, temperature=0, max_tokens=9, max_completion_tokens=5)
    assert (chosen.generate_request("r").sampling.temperature, chosen.generate_request("r").sampling.max_tokens) == (0, 5)


def test_values_that_mean_off_pass_and_fields_that_would_change_the_answer_are_refused():
    """A float 0.0 penalty, min_p 0.0 and repetition_penalty 1.0 are "off" as their integer forms
    are (they were refused); vLLM's top_k -1 is no top-k; max_completion_tokens holds for a text
    completion as for a chat. vLLM's guided decoding, structured outputs, stop strings kept in the
    output, chat template arguments and options, special tokens kept in the text and banned words
    would change the answer: refused by name, not dropped."""
    from router.openai_schema import ChatCompletionRequest, CompletionRequest, OpenAIError

    off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "repetition_penalty": 1.0,
           "include_stop_str_in_output": False, "top_k": -1, "add_generation_prompt": True,
           "continue_final_message": False, "skip_special_tokens": True}
    assert ChatCompletionRequest(messages=QUESTION, **off).generate_request("r").sampling.top_k == 0
    assert CompletionRequest(prompt="Hi", max_completion_tokens=40).generate_request("r").sampling.max_tokens == 40
    for field, value in [("guided_choice", ["yes", "no"]), ("guided_json", {"type": "object"}),
                         ("guided_regex", "[0-9]+"), ("structured_outputs", {"choice": ["a"]}),
                         ("include_stop_str_in_output", True), ("chat_template_kwargs", {"enable_thinking": False}),
                         ("continue_final_message", True), ("add_generation_prompt", False),
                         ("skip_special_tokens", False), ("bad_words", ["no"]), ("chat_template", "{{ x }}")]:
        with pytest.raises(OpenAIError) as e:
            ChatCompletionRequest(messages=QUESTION, **{field: value}).generate_request("r")
        assert (e.value.status, e.value.param) == (400, field)


def test_the_published_schema_takes_the_seeds_the_engine_takes():
    """Below 2**63 (the engine's generators): the API's schema said up to 2**64 - 1, and larger
    seeds were refused only after the request reached the router."""
    from router.openai_schema import ChatCompletionRequest

    (seed,) = [t for t in ChatCompletionRequest.model_json_schema()["properties"]["seed"]["anyOf"] if "type" in t
               and t["type"] == "integer"]
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (0, 2**63)


def test_each_problem_of_a_refusal_is_named_as_the_api_names_it():
    from router.openai_schema import api_field

    assert api_field("sampling.temperature: must be <= 2, got 3; sampling.top_p: must be > 0, got 0") == (
        "temperature: must be <= 2, got 3; top_p: must be > 0, got 0", "temperature")  # top_p kept its path


def test_strings_beside_token_id_lists_are_still_checked_for_text():
    """Lists of token ids are skipped (walking a million ids paused every other stream ~0.5 s);
    strings beside them, and in lists, are not."""
    from router.openai_schema import _lone_surrogate

    found = _lone_surrogate({"prompt": [[1, 2], [3]], "stop": ["ok", "\udc00"]}, "")
    assert found is not None and found.param == "stop" and "stop[1]" in found.message
