"""HFTokenizer renders and tokenizes exactly as transformers' apply_chat_template (which is
what vLLM calls), for ChatML-with-tools, Llama-3-style and Zephyr-like templates."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from router.tokenize import TokenizeError, load_tokenizer
from router.tokenize.conversation import detect_content_format
from router.tokenize.hf import HFTokenizer, TokenizerFilesError
from tests.fixtures.tokenizers.build import fixture_dirs

transformers = pytest.importorskip("transformers")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather <now> & 'later' in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City, e.g. Paris"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a word: ünïcödé ok",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    },
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Weather in Paris today?\n"},
        {"role": "assistant", "content": "Sunny, 21 degrees."},
        {"role": "user", "content": "Thank you! 😀 Merci."},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use the tools when helpful."},
        {"role": "user", "content": "Weather in Berlin and London?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Berlin"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "London"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain, 14 degrees"},
        {"role": "assistant", "content": "Berlin is sunny; London is rainy."},
        {"role": "user", "content": "And Paris?"},
    ],
}

TEMPLATES = ["chatml", "llama3", "zephyr"]


@pytest.fixture(scope="module")
def dirs() -> dict[str, Path]:
    return fixture_dirs()


@pytest.fixture(scope="module")
def ours(dirs: dict[str, Path]) -> dict[str, HFTokenizer]:
    return {name: HFTokenizer.from_dir(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[str, Any]:
    return {
        name: transformers.AutoTokenizer.from_pretrained(str(path)) for name, path in dirs.items()
    }


def hf_ids(ref: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(
        ref.apply_chat_template(copy.deepcopy(messages), tokenize=True, return_dict=False, **kwargs)
    )


def supports(template: str, conversation: str) -> bool:
    # the Zephyr-like template has no tool support and reads message['content'] only
    return not (template == "zephyr" and conversation == "tool_calls")


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
def test_chat_ids_equal_transformers_apply_chat_template(
    ours: dict[str, HFTokenizer],
    reference: dict[str, Any],
    template: str,
    conversation: str,
    with_tools: bool,
    add_generation_prompt: bool,
) -> None:
    if not supports(template, conversation):
        pytest.skip("template has no tool-call rendering")
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    expected = hf_ids(
        reference[template], messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    got = ours[template].encode_chat(
        messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert got == expected
    assert len(got) > 10


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize(
    "prompt", ["hello world", " leading space", "The router\n\nsends <|im_end|> x", "ünï😀"]
)
def test_completion_ids_equal_transformers_with_special_tokens(
    ours: dict[str, HFTokenizer], reference: dict[str, Any], template: str, prompt: str
) -> None:
    assert ours[template].encode_prompt(prompt) == reference[template](prompt)["input_ids"]


def test_llama3_completion_prompts_start_with_bos_and_chat_prompts_do_not_repeat_it(
    ours: dict[str, HFTokenizer],
) -> None:
    tok = ours["llama3"]
    bos = tok.tokenizer.token_to_id("<|begin_of_text|>")
    assert tok.encode_prompt("hi")[0] == bos
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == bos and chat[1] != bos  # the template emits BOS, tokenization adds none


def test_add_bos_token_in_config_is_ignored_like_transformers_does_with_tokenizer_json(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    bos = ours["zephyr"].tokenizer.token_to_id("<s>")
    assert bos not in ours["zephyr"].encode_prompt("hello")
    assert ours["zephyr"].encode_prompt("hello") == reference["zephyr"]("hello")["input_ids"]


def test_llama3_template_date_can_be_set_through_chat_template_kwargs(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    messages = CONVERSATIONS["single_user"]
    got = ours["llama3"].encode_chat(messages, chat_template_kwargs={"date_string": "26 Jul 2024"})
    expected = hf_ids(
        reference["llama3"], messages, add_generation_prompt=True, date_string="26 Jul 2024"
    )
    assert got == expected
    text = ours["llama3"].render_chat(messages, chat_template_kwargs={"date_string": "26 Jul 2024"})
    assert "Today Date: 26 Jul 2024" in text


def test_tool_call_arguments_given_as_json_strings_are_parsed_like_vllm(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    openai_style = copy.deepcopy(CONVERSATIONS["tool_calls"])
    for call in openai_style[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    expected = hf_ids(
        reference["chatml"], CONVERSATIONS["tool_calls"], tools=TOOLS, add_generation_prompt=True
    )
    assert ours["chatml"].encode_chat(openai_style, tools=TOOLS) == expected


def test_invalid_tool_call_arguments_become_an_empty_object_like_vllm(
    ours: dict[str, HFTokenizer],
) -> None:
    messages = copy.deepcopy(CONVERSATIONS["tool_calls"])
    messages[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    text = ours["chatml"].render_chat(messages, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {}}' in text


def test_tools_are_reserialised_in_vllm_key_order_with_missing_fields_as_null(
    ours: dict[str, HFTokenizer],
) -> None:
    tools = [{"function": {"parameters": {"type": "object"}, "name": "ping"}, "type": "function"}]
    text = ours["chatml"].render_chat([{"role": "user", "content": "x"}], tools=tools)
    expected = json.dumps(
        {
            "type": "function",
            "function": {"name": "ping", "description": None, "parameters": {"type": "object"}},
        }
    )
    assert "\n" + expected + "\n" in text


def test_text_content_parts_are_joined_with_newlines_for_string_templates(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        }
    ]
    expected = hf_ids(
        reference["chatml"],
        [{"role": "user", "content": "first\nsecond"}],
        add_generation_prompt=True,
    )
    assert detect_content_format(ours["chatml"].template_source()) == "string"
    assert ours["chatml"].encode_chat(parts) == expected


def test_content_parts_stay_a_list_for_templates_that_loop_over_content(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    tok = ours["parts"]
    assert detect_content_format(tok.template_source()) == "openai"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "plain string becomes one part"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "first "}, {"type": "text", "text": "second"}],
        },
    ]
    wrapped = [
        {"role": "system", "content": [{"type": "text", "text": "plain string becomes one part"}]},
        messages[1],
    ]
    expected = hf_ids(reference["parts"], wrapped, add_generation_prompt=True)
    assert tok.encode_chat(messages) == expected
    assert "first second" in tok.render_chat(messages)


def test_null_content_renders_as_empty_text(
    ours: dict[str, HFTokenizer], reference: dict[str, Any]
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    as_empty = [dict(m, content=m["content"] or "") for m in messages]
    expected = hf_ids(reference["chatml"], as_empty, add_generation_prompt=True)
    assert ours["chatml"].encode_chat(messages) == expected


def test_developer_role_becomes_a_leading_system_message_when_template_lacks_it(
    ours: dict[str, HFTokenizer],
) -> None:
    text = ours["chatml"].render_chat(
        [{"role": "user", "content": "q"}, {"role": "developer", "content": "be brief"}]
    )
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nq")


def test_extra_message_fields_do_not_reach_the_template(ours: dict[str, HFTokenizer]) -> None:
    plain = [{"role": "user", "content": "q"}]
    noisy = [{"role": "user", "content": "q", "weird": "x", "tool_calls": None}]
    assert ours["chatml"].encode_chat(noisy) == ours["chatml"].encode_chat(plain)


def test_template_raise_exception_becomes_tokenize_error_with_its_message(
    ours: dict[str, HFTokenizer],
) -> None:
    with pytest.raises(TokenizeError, match="unsupported role: narrator"):
        ours["chatml"].encode_chat([{"role": "narrator", "content": "once upon a time"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "must not be empty"),
        ("hello", "list of message objects"),
        ([{"content": "no role"}], r"messages\[0\] must have a string 'role'"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text parts",
        ),
        ([{"role": "user", "content": "x"}, 7], r"messages\[1\] must be an object"),
    ],
)
def test_bad_messages_get_a_clear_error_naming_the_problem(
    ours: dict[str, HFTokenizer], messages: Any, match: str
) -> None:
    with pytest.raises(TokenizeError, match=match):
        ours["chatml"].encode_chat(messages)


def test_bad_tools_get_a_clear_error(ours: dict[str, HFTokenizer]) -> None:
    with pytest.raises(TokenizeError, match=r"tools\[0\].function must be an object"):
        ours["chatml"].encode_chat([{"role": "user", "content": "x"}], tools=[{"type": "function"}])


def test_sandbox_refuses_unsafe_attribute_access(tmp_path: Path, dirs: dict[str, Path]) -> None:
    model = tmp_path / "evil"
    shutil.copytree(dirs["chatml"], model)
    (model / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tok = HFTokenizer.from_dir(model)
    with pytest.raises(TokenizeError):
        tok.encode_chat([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_takes_priority_over_tokenizer_config(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    model = tmp_path / "m"
    shutil.copytree(dirs["chatml"], model)
    (model / "chat_template.jinja").write_text("X{{ messages[0]['content'] }}Y")
    assert HFTokenizer.from_dir(model).render_chat([{"role": "user", "content": "c"}]) == "XcY"


def test_named_templates_pick_tool_use_for_requests_with_tools(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    model = tmp_path / "m"
    shutil.copytree(dirs["chatml"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_dir(model)
    assert tok.render_chat([{"role": "user", "content": "c"}]) == "Dc"
    assert tok.render_chat([{"role": "user", "content": "c"}], tools=TOOLS) == "T2"


def test_model_without_chat_template_rejects_chat_but_tokenizes_prompts(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    model = tmp_path / "base"
    shutil.copytree(dirs["llama3"], model)
    (model / "chat_template.jinja").unlink()
    tok = HFTokenizer.from_dir(model)
    assert tok.encode_prompt("hello")
    with pytest.raises(TokenizeError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


def test_loads_from_hf_cache_repo_snapshot_and_repo_id_without_network(
    tmp_path: Path, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(dirs["chatml"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    expected = HFTokenizer.from_dir(dirs["chatml"]).encode_chat(CONVERSATIONS["single_user"])
    for spec in (str(repo), str(snapshot), "acme/tiny-chat", "hf:acme/tiny-chat"):
        tok = load_tokenizer(spec)
        assert tok.encode_chat(CONVERSATIONS["single_user"]) == expected, spec


def test_missing_tokenizer_json_error_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=r"no tokenizer\.json found"):
        HFTokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_config_error_names_the_file(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    model = tmp_path / "m"
    shutil.copytree(dirs["chatml"], model)
    (model / "tokenizer_config.json").write_text("{ not json")
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config\.json"):
        HFTokenizer.from_dir(model)


TINY = Path("/tmp/vllmcpu/tiny-llama")


@pytest.mark.skipif(not (TINY / "tokenizer.json").is_file(), reason=f"{TINY} not built")
def test_engine_tiny_model_dir_matches_transformers() -> None:
    tok = HFTokenizer.from_dir(TINY)
    ref = transformers.AutoTokenizer.from_pretrained(str(TINY))
    for messages in (CONVERSATIONS["single_user"], CONVERSATIONS["system_multi_turn"]):
        assert tok.encode_chat(messages) == hf_ids(ref, messages, add_generation_prompt=True)
    assert tok.encode_prompt("Hello there") == ref("Hello there")["input_ids"]


def test_model_specific_tokenizer_class_is_flagged_for_runtime_verification(
    tmp_path: Path, dirs: dict[str, Path]
) -> None:
    model = tmp_path / "qwen-like"
    shutil.copytree(dirs["chatml"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    flagged = HFTokenizer.from_dir(model)
    assert flagged.tokenizer_class == "Qwen2Tokenizer"
    assert flagged.warnings and "check_against_engine" in flagged.warnings[0]
    assert HFTokenizer.from_dir(dirs["chatml"]).warnings == []  # PreTrainedTokenizerFast


@pytest.mark.parametrize("template", TEMPLATES)
def test_continue_final_message_matches_transformers(
    ours: dict[str, HFTokenizer], reference: dict[str, Any], template: str
) -> None:
    messages = [
        {"role": "user", "content": "Finish my sentence."},
        {"role": "assistant", "content": "The answer is "},
    ]
    kwargs = {"date_string": "1 Jan 2026"}
    expected = hf_ids(
        reference[template],
        messages,
        add_generation_prompt=False,
        continue_final_message=True,
        **kwargs,
    )
    got = ours[template].encode_chat(
        messages,
        add_generation_prompt=False,
        chat_template_kwargs={"continue_final_message": True, **kwargs},
    )
    assert got == expected
    with pytest.raises(TokenizeError, match="cannot both be true"):
        ours[template].encode_chat(messages, chat_template_kwargs={"continue_final_message": True})
