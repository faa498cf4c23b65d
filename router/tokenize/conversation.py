"""OpenAI chat messages -> the conversation vLLM hands to the chat template.

vLLM (``vllm/renderers/chat_utils.py``, ``vllm/renderers/hf.py``) does not pass request
messages to the template verbatim.  This module reproduces the steps that change the
rendered text for text-only requests:

* **content format** — detected once per template from its AST: ``"openai"`` when the
  template loops over ``message['content']`` (content stays a list of
  ``{"type": "text", "text": ...}`` parts), else ``"string"`` (text parts joined with
  ``"\\n"``; ``None`` content becomes ``""``);
* only ``role``, ``content``, ``tool_calls`` (assistant), ``reasoning`` /
  ``reasoning_content`` (assistant), ``tool_call_id`` (tool), ``name`` and ``task`` are
  kept; a tool message's list content is always joined to a string;
* a system message's leading ``x-anthropic-billing-header`` line is dropped;
* assistant ``tool_calls[*].function.arguments`` JSON strings are parsed to objects
  (invalid JSON or a non-object -> ``{}``); an empty ``tool_calls`` list is dropped;
* ``developer`` messages become ``system`` (merged into one leading system message) when
  the template never mentions ``"developer"``;
* tools become ``{"type": "function", "function": {"name", "description", "parameters"
  [, "strict"]}}`` in that key order (vLLM re-serialises them with pydantic);
* then, as ``transformers`` does, keys whose value is ``None`` are dropped and reasoning
  is aliased (``reasoning_content`` / ``thinking``).

Media parts (images, audio, ...) are rejected: the router cannot expand them the way the
engine's processor does (use the ``remote`` tokenizer for multimodal models).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

import jinja2.nodes

from router.tokenize.base import TokenizeError
from router.tokenize.template import parse_template

ContentFormat = Literal["string", "openai"]

_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_KNOWN_PART_FIELDS = frozenset(
    {"type", "text", "refusal", "thinking", "signature", "image_url", "input_audio", "uuid"}
)
_BILLING_HEADER = "x-anthropic-billing-header"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# --- content format detection (AST walk, as vLLM's _detect_content_format) -------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _accesses(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or ``name[key]``), possibly through filters/tests/slices."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (transitively)."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _accesses(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_loop_vars(root: jinja2.nodes.Template) -> list[str]:
    names = list(_aliases(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, n) for n in names) and isinstance(
            loop.target, jinja2.nodes.Name
        ):
            out.append(loop.target.name)
    return out


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    message_vars = _message_loop_vars(root)
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_accesses(arg, v, "content") for v in message_vars):
                    params.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_accesses(kw.value, v, "content") for v in message_vars):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, v, "content") for v in message_vars):
            return True
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name):
            if it.name in macro_params.get(id(loop), set()):
                return True
            if id(loop) not in in_macros and it.name == "content":
                return True
    return False


@lru_cache(maxsize=64)
def detect_content_format(template_source: str) -> ContentFormat:
    """``"openai"`` if the template iterates over a message's content parts, else ``"string"``."""
    try:
        root = parse_template(template_source)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(root) else "string"


@lru_cache(maxsize=64)
def supports_developer_role(template_source: str) -> bool:
    return '"developer"' in template_source or "'developer'" in template_source


# --- message normalisation -------------------------------------------------------------


def _text_parts(content: Any, index: int) -> list[dict[str, Any]]:
    """Content -> text parts ``{"type": "text", "text": ..., **extra}``; media is an error."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise TokenizeError(
            f"messages[{index}].content must be a string, a list of parts or null, "
            f"got {type(content).__name__}"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if type(part) is not dict and not isinstance(part, Mapping):
            raise TokenizeError(f"messages[{index}].content[{j}] must be an object")
        kind = part.get("type")
        if kind in _TEXT_PART_KEYS:
            text = part.get(_TEXT_PART_KEYS[kind])
            if text is None:
                continue  # vLLM skips text parts without text
            if not isinstance(text, str):
                raise TokenizeError(f"messages[{index}].content[{j}].text must be a string")
            extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
            parts.append({"type": "text", "text": text, **extra})
        else:
            raise TokenizeError(
                f"messages[{index}].content[{j}] has type {kind!r}: only text parts can be "
                "tokenized by the router (use the remote tokenizer for multimodal models)"
            )
    return parts


def _strip_billing_header(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for part in parts:
        text = part["text"]
        if text.startswith(_BILLING_HEADER):
            rest = text.partition("\n")[2]
            if rest:
                out.append({**part, "text": rest})
            continue
        out.append(part)
    return out


def _parse_arguments(arguments: Any) -> dict[str, Any]:
    if not arguments:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return dict(parsed) if isinstance(parsed, dict) else {}


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list):
        return None
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise TokenizeError(f"messages[{index}].tool_calls[{j}] must be an object")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise TokenizeError(
                f"messages[{index}].tool_calls[{j}] must be a function call "
                "({'type': 'function', 'function': {...}})"
            )
        new_call = {k: _plain(v) for k, v in call.items()}
        new_call["function"] = {
            **{k: _plain(v) for k, v in function.items()},
            "arguments": _parse_arguments(function.get("arguments")),
        }
        out.append(new_call)
    return out


def _plain(value: Any) -> Any:
    """A deep copy made of plain JSON types (what the sandboxed template may see)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _join_text(parts: list[dict[str, Any]]) -> str:
    return "\n".join(p["text"] for p in parts)


def normalize_messages(
    messages: Sequence[Mapping[str, Any]],
    content_format: ContentFormat,
    *,
    developer_role: bool = True,
) -> list[dict[str, Any]]:
    """The conversation vLLM renders for ``messages`` (see the module docstring)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizeError("messages must be a list of message objects")
    if not messages:
        raise TokenizeError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if type(msg) is not dict and not isinstance(msg, Mapping):
            raise TokenizeError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizeError(f"messages[{i}] must have a string 'role'")
        content = msg.get("content")
        new: dict[str, Any]
        if (
            type(content) is str
            and content_format == "string"
            and not (role == "system" and content.startswith(_BILLING_HEADER))
        ):
            new = {"role": role, "content": content}  # the common case, unchanged
        else:
            parts = _text_parts(content, i)
            if role == "system":
                parts = _strip_billing_header(parts)
            if content_format == "openai" and role != "tool":
                new = {"role": role, "content": parts}
            else:
                new = {"role": role, "content": _join_text(parts)}
        if role == "assistant":
            calls = _tool_calls(msg.get("tool_calls"), i)
            if calls:
                new["tool_calls"] = calls
            reasoning = msg.get("reasoning")
            if reasoning is not None:
                new["reasoning"] = reasoning
                new["reasoning_content"] = reasoning
        elif role == "tool" and msg.get("tool_call_id") is not None:
            new["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            new["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            new["task"] = msg["task"]
        if role == "developer" and msg.get("tools") is not None:
            new["tools"] = _plain(msg["tools"])
        out.append(new)
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _developer_to_system(out)
    return [_hf_normalize(m) for m in out]


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] == "system":
            if i > 0 or systems:
                merge = True
            content = msg.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content if "text" in p)
            if content:
                systems.append(content)
        else:
            rest.append(msg)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def _hf_normalize(msg: dict[str, Any]) -> dict[str, Any]:
    """transformers: drop ``None`` values, alias the reasoning fields."""
    if None in msg.values():
        msg = {k: v for k, v in msg.items() if v is not None}
    if "reasoning" in msg or "reasoning_content" in msg or "thinking" in msg:
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tools -> ``[{"type": "function", "function": {name, description, parameters}}]``."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise TokenizeError("tools must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TokenizeError(f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            raise TokenizeError(f"tools[{i}].type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TokenizeError(f"tools[{i}].function must be an object with a string 'name'")
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": _plain(fn.get("parameters")),
        }
        if fn.get("strict") is not None:
            function["strict"] = fn["strict"]
        if fn.get("defer_loading") is not None:
            function["defer_loading"] = fn["defer_loading"]
        entry: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out
