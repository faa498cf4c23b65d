"""A request as the decision core sees it: the body's checks, and the decided
:class:`Routed` (what to send, where first, and where next on a retry).

Validation (every failure is a :class:`~router.errors.RouterError`, counted by reason by
the caller): body not JSON / not an object / nested deeper than ``max_depth`` -> 400
``invalid_json``; chat ``messages``
absent, empty or malformed -> 400 ``invalid_messages``; completions ``prompt`` not a
string, list of strings, token-id list or list of token-id lists -> 400
``invalid_prompt``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from router.errors import RouterError, bad_request
from scoring.policies.base import Decision, PodView, RouteRequest

if TYPE_CHECKING:
    from router.decision.disagg import PDPlan

Kind = Literal["chat", "completion", "embedding", "passthrough", "responses"]

_decode = msgspec.json.decode
_MAX_ID = 1 << 32  # token ids are hashed as uint32

#: JSON nesting refused past this depth (the top-level object is depth 1); serde_json's
#: default recursion limit.  msgspec itself stops at the interpreter's recursion limit
#: (~1000 levels less the caller's stack) with a RecursionError
DEFAULT_MAX_JSON_DEPTH = 128


@dataclass(slots=True)
class Routed:
    """A decided request: what to send, where first, and where next on a retry."""

    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    route: RouteRequest
    decision: Decision
    #: candidate pods, best first (the decision's pod first)
    ranking: list[str]
    views: dict[str, PodView]
    tokenizer_name: str = "none"
    approximate: bool = False
    #: the tenant that sent it (None: tenancy off); set by :meth:`RequestRouter.decide`
    tenant: str | None = None
    #: prefill/decode: the plan of a model whose pods have roles (router.decision.disagg)
    pd: PDPlan | None = None

    def cached_tokens(self, pod: str) -> int:
        """Prompt tokens the index says ``pod`` holds (any tier)."""
        view = self.views.get(pod)
        if view is None or not view.hits:
            return 0
        return min(view.best_cached_blocks() * self.route.block_size, self.route.prompt_tokens)


def parse_body(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 ``invalid_json`` when it is not one or nests deeper
    than ``max_depth`` levels.

    msgspec cannot bound the depth itself (it stops only at the interpreter's recursion
    limit, caught here; a depth-bounded type makes its decoder build exponentially), so
    the depth is walked, but only for bodies with more than ``max_depth`` brackets: no
    body nests deeper than it has brackets, and counting them runs at C speed.  A short
    request pays two ``bytes.count``; a long chat (hundreds of brackets) a walk of its
    containers, about as long as its decoding (tests/bench/bench_parse_body.py)."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:  # msgspec's own bound, far past any configured depth
        raise _too_deep(max_depth) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    if raw.count(b"{") + raw.count(b"[") > max_depth and _deeper_than(body, max_depth):
        raise _too_deep(max_depth)
    return body


def _too_deep(max_depth: int) -> RouterError:
    return bad_request(
        f"request body nests JSON deeper than {max_depth} levels (proxy.max_json_depth)",
        "invalid_json",
    )


def _deeper_than(body: dict[str, Any], limit: int) -> bool:
    """True when ``body`` (level 1) nests objects / arrays more than ``limit`` levels
    deep; level by level, containers only (the fastest plain-Python walk measured)."""
    level: list[Any] = [body]
    depth = 1
    while True:
        deeper: list[Any] = []
        keep = deeper.append
        for node in level:
            for child in node.values() if type(node) is dict else node:
                t = type(child)
                if t is dict or t is list:
                    keep(child)
        if not deeper:
            return False
        if depth >= limit:
            return True
        level = deeper
        depth += 1


def check_messages(messages: Any) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' must be a non-empty list of message objects",
            "invalid_messages",
            param="messages",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(
                f"messages[{i}] must be an object with a string 'role'",
                "invalid_messages",
                param=f"messages[{i}]",
            )
    return messages


def _token_ids(ids: list[Any]) -> bool:
    """Every item a token id: an int (not a bool) in [0, 2**32)."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _MAX_ID for t in ids)


def first_prompt(prompt: Any) -> str | list[int]:
    """The prompt to route on: a string or token ids (the first of a batch)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        head = prompt[0]
        if _token_ids(prompt):
            return prompt
        if isinstance(head, str) and all(isinstance(p, str) for p in prompt):
            return head
        if isinstance(head, list) and head and _token_ids(head):
            return head
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists (non-empty; token ids in [0, 2**32))",
        "invalid_prompt",
        param="prompt",
    )


def without_prompt(
    kind: Kind,
    body: dict[str, Any],
    model: str,
    stream: bool,
    request_id: str,
    ranking: list[str],
    scores: dict[str, float],
    views: dict[str, PodView],
    detail: dict[str, Any] | None = None,
) -> Routed:
    """A decision that scored no prompt (least loaded, or a stored response's owner):
    no tokens, no block keys; ``ranking`` best first, ``scores`` lower is better."""
    route = RouteRequest(
        request_id=request_id, model=model, prompt_tokens=0, block_keys=[], block_size=1
    )
    decision = Decision(ranking[0], scores, lower_is_better=True, detail=detail or {})
    return Routed(kind, body, model, stream, route, decision, ranking, views)


def rank(decision: Decision, names: Sequence[str]) -> list[str]:
    """Candidates best first: the decision's pod, then by score (unscored pods last;
    equal scores keep the candidates' order)."""
    scores = decision.scores
    chosen = decision.pod
    rest = [n for n in names if n != chosen]
    if len(rest) > 1:
        try:  # the usual case: every candidate scored
            rest.sort(key=scores.__getitem__, reverse=not decision.lower_is_better)
        except KeyError:  # (a failed sort leaves the list in some order: sort again)
            sign = 1.0 if decision.lower_is_better else -1.0
            worst = float("inf")
            rest = [n for n in names if n != chosen]
            rest.sort(key=lambda n: sign * scores[n] if n in scores else worst)
    return [chosen, *rest]
