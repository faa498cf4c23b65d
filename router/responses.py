"""The OpenAI Responses API (``/v1/responses``) at the router: which requests can be
scored, who owns a stored response, and finding a response's id in a pod's answer.

vLLM keeps stored responses in the serving process (``OpenAIServingResponses.
response_store`` / ``msg_store``): a follow-up naming ``previous_response_id``, and
``GET`` / ``cancel`` of an id, only work on the pod that created the response.  The
router records ``response id -> pod`` after each 2xx (:class:`OwnerStore`: in memory,
or in Redis so every replica sees it) and sends those requests to the owner.

A new response is routed cache-aware only when it converts to chat messages exactly as
vLLM's ``construct_input_messages`` does (:func:`to_chat`): then it is tokenized as the
equivalent chat request.  Anything else is routed least-loaded and counted as
unscored, with the reason; a tokenization that may not match the engine's is never
guessed.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

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


# -- the response id in a pod's answer -------------------------------------------------------


def id_from_body(content: bytes) -> str | None:
    """``id`` of a non-streaming Responses answer (None when there is none)."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    rid = body.get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) and rid else None


class CreatedSniffer:
    """Finds the response id in a streaming answer: the ``response.created`` event's
    ``response.id``.  Chunks are fed as they are relayed; only the text up to the end
    of the first events is kept (bounded), and nothing once the id is found."""

    #: give up when the first event is not complete within this many bytes
    LIMIT = 1 << 16

    __slots__ = ("_buf", "done", "id")

    def __init__(self) -> None:
        self._buf = b""
        self.done = False
        self.id: str | None = None

    def feed(self, chunk: bytes) -> str | None:
        """The id once found in the stream so far (returned once), else None."""
        if self.done:
            return None
        self._buf += chunk
        while True:
            buf = self._buf.replace(b"\r\n", b"\n")
            end = buf.find(b"\n\n")
            if end < 0:
                if len(self._buf) > self.LIMIT:
                    self.done = True
                    self._buf = b""
                return None
            event, self._buf = buf[:end], buf[end + 2 :]
            rid = _created_id(event)
            if rid is not None or self._event_named_other(event):
                self.done = True
                self._buf = b""
                self.id = rid
                return rid

    @staticmethod
    def _event_named_other(event: bytes) -> bool:
        """A complete event that is not ``response.created``: the id will not come
        (``response.created`` is vLLM's first event)."""
        return any(
            line.startswith(b"data:") or line.startswith(b"event:") for line in event.split(b"\n")
        )


def _created_id(event: bytes) -> str | None:
    name = None
    data = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            data.append(line[5:].strip())
    if not data:
        return None
    try:
        obj = json.loads(b"\n".join(data))
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    kind = obj.get("type")
    if name is None and isinstance(kind, str):
        name = kind.encode()
    if name != b"response.created":
        return None
    resp = obj.get("response")
    rid = resp.get("id") if isinstance(resp, dict) else None
    return rid if isinstance(rid, str) and rid else None


# -- who owns a response ----------------------------------------------------------------------


class OwnerStore(Protocol):
    """``response id -> pod`` for the pods' stored responses."""

    async def get(self, response_id: str) -> str | None: ...

    async def put(self, response_id: str, pod: str) -> None: ...

    async def close(self) -> None: ...


class MemoryOwnerStore:
    """This replica's owners: a bounded LRU, each entry kept ``ttl_s`` after it was
    recorded (a replica that did not create a response does not know its owner: use
    Redis with several replicas)."""

    def __init__(self, max_owners: int, ttl_s: float) -> None:
        self.max_owners = max_owners
        self.ttl_s = ttl_s
        self._owners: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def get(self, response_id: str) -> str | None:
        entry = self._owners.get(response_id)
        if entry is None:
            return None
        pod, expires = entry
        if time.monotonic() >= expires:
            del self._owners[response_id]
            return None
        self._owners.move_to_end(response_id)
        return pod

    async def put(self, response_id: str, pod: str) -> None:
        owners = self._owners
        owners[response_id] = (pod, time.monotonic() + self.ttl_s)
        owners.move_to_end(response_id)
        while len(owners) > self.max_owners:
            owners.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owners)

    async def close(self) -> None:
        self._owners.clear()


class RedisOwnerStore:
    """Owners shared by every replica: ``{namespace}:resp:{id}`` -> pod, expiring
    ``ttl_s`` after it was recorded.

    ``client`` -- a ``scoring.index.redis_guard.RedisGuard`` shared with the process's
    other stores on that Redis (one pool, one breaker), or a ``redis.asyncio.Redis``
    (wrapped in a guard of its own).  ``get`` and ``put`` have the guard's request
    deadline and raise ``scoring.index.breaker.SharedStateUnavailable`` on any Redis
    failure, or at once while the breaker is open."""

    def __init__(self, client: Any, namespace: str, ttl_s: float, *, owns_client: bool) -> None:
        from scoring.index.redis_guard import RedisGuard

        self.guard = (
            client
            if isinstance(client, RedisGuard)
            else RedisGuard(client, owns_client=owns_client)
        )
        self._r = self.guard.client
        self._prefix = f"{namespace}:resp:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._owns = owns_client

    @classmethod
    def from_url(
        cls, url: str, namespace: str, ttl_s: float, **guard_kwargs: Any
    ) -> RedisOwnerStore:
        """A store owning a new guarded client (``guard_kwargs``: ``breaker``, the
        deadlines, client options -- see ``RedisGuard.from_url``)."""
        from scoring.index.redis_guard import RedisGuard

        return cls(RedisGuard.from_url(url, **guard_kwargs), namespace, ttl_s, owns_client=True)

    def key(self, response_id: str) -> str:
        return self._prefix + response_id

    async def get(self, response_id: str) -> str | None:
        key = self._prefix + response_id
        value = await self.guard.call("owner_get", lambda: self._r.get(key), request=True)
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def put(self, response_id: str, pod: str) -> None:
        key, value = self._prefix + response_id, pod.encode()
        await self.guard.call(
            "owner_put", lambda: self._r.set(key, value, px=self._ttl_ms), request=True
        )

    async def close(self) -> None:
        if self._owns:
            await self.guard.aclose()
