"""The OpenAI Responses API (``/v1/responses``) at the router: which requests can be
scored (:func:`to_chat`).  Who owns a stored response is :mod:`router.decision.owners`;
finding a response's id in a pod's answer is :mod:`router.proxy.response_ids`.

vLLM keeps stored responses in the serving process (``OpenAIServingResponses.
response_store`` / ``msg_store``): a follow-up naming ``previous_response_id``, and
``GET`` / ``cancel`` of an id, only work on the pod that created the response.  The
router records ``response id -> pod`` after each 2xx (an owner store: in memory, or in
Redis so every replica sees it) and sends those requests to the owner.

A new response is routed cache-aware only when it converts to chat messages exactly as
vLLM's ``construct_input_messages`` does (:func:`to_chat`): then it is tokenized as the
equivalent chat request.  Anything else is routed least-loaded and counted as
unscored, with the reason; a tokenization that may not match the engine's is never
guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ROLES = frozenset({"user", "system", "developer", "assistant"})
#: keys of a message item that change nothing vLLM renders (``id`` / ``status`` of an
#: assistant output message; ``type`` "message")
_MESSAGE_KEYS = frozenset({"type", "role", "content"})
_ASSISTANT_KEYS = _MESSAGE_KEYS | {"id", "status"}
_TOOL_KEYS = frozenset(
    {
        "type",
        "name",
        "description",
        "parameters",
        "strict",
        "defer_loading",
        # dropped by vLLM's FunctionDefinition: never rendered
        "allowed_callers",
        "async",
        "output_schema",
    }
)
#: input item types named in the unscored metric (any other: "input_item"; a label
#: value never comes from the client unchecked)
_ITEM_TYPES = frozenset(
    {
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "reasoning",
        "item_reference",
        "mcp_call",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
    }
)
#: request fields that make vLLM render something a plain conversion does not show
_UNSCORED_FIELDS = (
    ("previous_input_messages", "previous_input_messages"),
    ("reasoning", "reasoning"),
    ("prompt", "prompt_template"),
)


@dataclass(frozen=True, slots=True)
class ChatForm:
    """A Responses request as the chat request vLLM renders for it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class Unscored(Exception):
    """The request cannot be converted exactly; ``reason`` is the metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def to_chat(body: Mapping[str, Any]) -> ChatForm:
    """The chat messages (and chat-format tools) vLLM renders for a new response, or
    :class:`Unscored` when the conversion is not the plain, exact one.

    Exact cases (vLLM 0.32 ``construct_input_messages`` and
    ``_construct_message_from_response_item``): ``instructions`` -> a system message
    first (an empty string adds none); a string ``input`` -> one user message; a list
    of message items (``type`` "message" or absent) whose role is user, system,
    developer or assistant and whose content is a string or a list of text parts
    (``input_text`` / ``output_text``).  A user/system/developer item keeps its parts
    (vLLM passes the item on as the message); an assistant item with parts (``type``
    "message" required, as vLLM's parser does) becomes its *first* part's text (vLLM
    reads ``content[0].text``).  ``tools`` of type
    "function" become chat tools ``{"type": "function", "function": {...}}``
    (``convert_tool_responses_to_completions_format``); an empty list renders as none.
    """
    for field, reason in _UNSCORED_FIELDS:
        if body.get(field) is not None:
            raise Unscored(reason)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise Unscored("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for item in inp:
            messages.append(_message(item))
    else:
        raise Unscored("input")
    return ChatForm(messages, _tools(body.get("tools")))


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise Unscored("input_item")
    kind = item.get("type", "message")
    if kind != "message":
        # function_call, function_call_output, reasoning, item_reference ...
        raise Unscored(kind if kind in _ITEM_TYPES else "input_item")
    role = item.get("role")
    if role not in _ROLES:
        raise Unscored("input_role")
    content = item.get("content")
    if role == "assistant":
        if not item.keys() <= _ASSISTANT_KEYS or item.get("status", "completed") != "completed":
            raise Unscored("assistant_item")  # a partial message is continued, not answered
        if isinstance(content, str):
            return {"role": "assistant", "content": content}
        if item.get("type") != "message":
            # vLLM 0.32 rejects parts in an assistant item without type "message" (it
            # parses neither as an input message nor as an output message)
            raise Unscored("assistant_item")
        texts = _texts(content, ("output_text",))
        return {"role": "assistant", "content": texts[0]}
    if not item.keys() <= _MESSAGE_KEYS:
        raise Unscored("message_fields")
    if isinstance(content, str):
        return {"role": role, "content": content}
    texts = _texts(content, ("input_text",))
    return {"role": role, "content": [{"type": "text", "text": t} for t in texts]}


def _texts(content: Any, kinds: tuple[str, ...]) -> list[str]:
    """The texts of a non-empty list of text parts of the given types (else Unscored:
    images, files, refusals...)."""
    if not isinstance(content, list) or not content:
        raise Unscored("content")
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in kinds
            or not isinstance(part.get("text"), str)
            or not part.keys() <= {"type", "text", "annotations", "logprobs"}
        ):
            raise Unscored("content_part")
        texts.append(part["text"])
    return texts


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unscored("tools")
    out = []
    for tool in tools:
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
            or not tool.keys() <= _TOOL_KEYS
            or not isinstance(tool.get("description"), str | None)
            or not isinstance(tool.get("parameters"), dict | None)
            or not isinstance(tool.get("strict"), bool | None)
            or not isinstance(tool.get("defer_loading"), bool | None)
        ):
            raise Unscored("tools")  # namespaces, custom and built-in tools
        function: dict[str, Any] = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out or None
