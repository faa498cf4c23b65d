"""The request path up to the decision: body -> validated request -> tokens -> block
keys -> index lookup -> pod views -> policy -> ranked pods.

Nothing here does network I/O towards pods (the index and the load store may be
Redis).  :class:`RequestRouter` is built once per app by the lifespan.

Validation (every failure is a :class:`~router.errors.RouterError`, counted by reason):

* body not JSON / not an object -> 400 ``invalid_json``; ``model`` missing -> 400
  ``missing_model``; chat ``messages`` absent, empty or malformed -> 400
  ``invalid_messages``; completions ``prompt`` not a string, list of strings, token-id
  list or list of token-id lists -> 400 ``invalid_prompt``; ``stream`` not a boolean ->
  400 ``invalid_stream``;
* a model no pod serves -> 404 ``model_not_found``; served only by unhealthy pods -> 503;
* prompt longer than the smallest ``max_model_len`` of the candidates (config, else
  learned from the pods' ``/v1/models``) -> 400 ``context_length_exceeded``.

The LoRA rule: a ``model`` that is not a pod's base model is an adapter; its block keys
are chained from the base model's root with the adapter name folded into every block
(as the indexer does with the events' ``lora_name``).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from router.config import Settings
from router.decision.responses import OwnerStore, Unscored, to_chat
from router.errors import RouterError, bad_request
from router.fleet.load import LoadStore, MemoryLoadStore, MetricsScraper, PendingLoad
from router.fleet.pods import PodRegistry, PodState
from router.metrics import RouterMetrics
from router.tokenize import ChatEncoder, EncodedPrompt, PromptTokenizer, TokenizeError
from scoring.blocks import BlockHasher
from scoring.index.base import BlockIndex
from scoring.index.memory import InMemoryIndex
from scoring.policies.base import Decision, PodView, Policy, RouteRequest

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion", "embedding", "passthrough", "responses"]

DEFAULT_BLOCK_SIZE = 16
_decode = msgspec.json.decode
_MAX_ID = 1 << 32  # token ids are hashed as uint32
_perf = time.perf_counter
_monotonic = time.monotonic
#: an in-memory index's per-pod entry counts are re-read at most this often
RESIDENT_STALE_S = 0.05


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

    def cached_tokens(self, pod: str) -> int:
        """Prompt tokens the index says ``pod`` holds (any tier)."""
        view = self.views.get(pod)
        if view is None or not view.hits:
            return 0
        return min(view.best_cached_blocks() * self.route.block_size, self.route.prompt_tokens)


class _Encoding:
    """A model's encoder with what the request path needs of it, looked up once."""

    __slots__ = ("encoder", "hist", "name")

    def __init__(self, encoder: ChatEncoder, name: str, hist: Any) -> None:
        self.encoder = encoder
        #: the tokenizer's name (metrics label, /v1/route)
        self.name = name
        #: its child of kvroute_tokenization_seconds
        self.hist = hist


_NO_LOAD = (0, 0)


class _Plan:
    """What the request path derives from a model and its candidate pods (base model
    and adapter, block size, encoder, max length), kept while the fleet and the scraped
    values it was derived from are unchanged (``version``)."""

    __slots__ = ("base", "block_size", "encoding", "lora", "max_len", "version")

    def __init__(
        self,
        version: tuple[int, int],
        base: str,
        lora: str | None,
        block_size: int,
        encoding: _Encoding,
        max_len: int | None,
    ) -> None:
        self.version = version
        self.base = base
        self.lora = lora
        self.block_size = block_size
        self.encoding = encoding
        self.max_len = max_len


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return body


def _check_messages(messages: Any) -> Sequence[Mapping[str, Any]]:
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


def _first_prompt(prompt: Any) -> str | list[int]:
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


class RequestRouter:
    """Turns request bodies into routing decisions."""

    def __init__(
        self,
        settings: Settings,
        registry: PodRegistry,
        index: BlockIndex,
        policy: Policy,
        load: LoadStore,
        scraper: MetricsScraper | None,
        tokenizer_for: Callable[[str], PromptTokenizer],
        metrics: RouterMetrics,
        pending: PendingLoad | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.index = index
        self.policy = policy
        self.load = load
        self.scraper = scraper
        self.tokenizer_for = tokenizer_for
        self.metrics = metrics
        self.pending = pending if pending is not None else PendingLoad()
        self._encoders: dict[tuple[int, str, int], _Encoding] = {}
        self._plans: dict[tuple[str, ...], _Plan] = {}
        # an in-memory index and load store are read without awaiting (no coroutine per
        # request for what is a dict lookup)
        self._local_load = load if isinstance(load, MemoryLoadStore) else None
        self._lookup_now = index.lookup_sync if isinstance(index, InMemoryIndex) else None
        #: pod -> index entries, for the policy's ``PodView.resident_blocks``; kept fresh
        #: here for an in-memory index, set by the app's index-gauge loop for Redis
        self.resident: Mapping[str, int] = {}
        self._entries_now = index.pod_entries_sync if isinstance(index, InMemoryIndex) else None
        self._resident_at = float("-inf")
        self._decision_hist = metrics.decision_seconds.labels()
        self._rr = 0
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]
        #: engine-hash mode: called with each routed request's chain
        #: ``(base model, token ids, block size, block keys, *, lora, cache_salt)``; must
        #: not block (``router.events.IndexSink.learn_later`` only queues it)
        self.on_routed: Callable[..., None] | None = None
        #: who created which stored response (``/v1/responses``); set by the app
        self.owners: OwnerStore | None = None

    def _next_id(self) -> str:
        """A request id unique across replicas (random prefix + counter; cheaper than
        a uuid4 per request)."""
        return f"{self._id_prefix}-{next(self._ids)}"

    # -- helpers ---------------------------------------------------------------------

    def reject(self, err: RouterError) -> RouterError:
        self.metrics.child(self.metrics.bad_requests, err.reason).inc()
        return err

    def _candidates(self, model: str) -> list[PodState]:
        pods = self.registry.candidates(model)
        if pods:
            return pods
        if any(model in p.models for p in self.registry.all()):
            raise RouterError(
                503,
                f"no healthy pod serves model {model!r} right now",
                reason="no_healthy_pod",
                param="model",
            )
        served = ", ".join(sorted(self.registry.served_models())) or "none"
        raise RouterError(
            404,
            f"the model {model!r} does not exist; served models: {served}",
            reason="model_not_found",
            param="model",
        )

    def _base_and_lora(self, model: str, pods: Sequence[PodState]) -> tuple[str, str | None]:
        parent = self.scraper.parents.get(model) if self.scraper is not None else None
        if parent:
            return parent, model
        for p in pods:
            if p.spec.models:
                base = p.spec.models[0]
                return base, (None if base == model else model)
        return model, None

    def block_size(self, model: str, pods: Sequence[str]) -> int:
        configured = self.settings.block_size_for(model)
        if configured:
            return configured
        if self.scraper is not None:
            learned = self.scraper.block_size(pods)
            if learned:
                return learned
        return DEFAULT_BLOCK_SIZE

    def _encoder(self, model: str, base: str, block_size: int) -> ChatEncoder:
        """One multi-turn-reusing encoder per (tokenizer, base model, block size)."""
        return self._encoding(model, base, block_size).encoder

    def _encoding(self, model: str, base: str, block_size: int) -> _Encoding:
        tok = self.tokenizer_for(model)
        key = (id(tok), base, block_size)
        entry = self._encoders.get(key)
        if entry is None:
            encoder = ChatEncoder(tok, BlockHasher(block_size, base))
            name = getattr(tok, "name", "unknown")
            m = self.metrics
            entry = self._encoders[key] = _Encoding(encoder, name, m.tokenize_seconds.labels(name))
        return entry

    def _plan(self, model: str, pods: Sequence[PodState], names: list[str]) -> _Plan:
        """:meth:`_base_and_lora`, :meth:`block_size`, :meth:`_encoding` and
        :meth:`_max_len` for ``model`` on ``names``, recomputed when the fleet or the
        scraped values changed."""
        version = (self.registry.version, self.scraper.version if self.scraper else 0)
        key = (model, *names)
        plan = self._plans.get(key)
        if plan is None or plan.version != version:
            base, lora = self._base_and_lora(model, pods)
            bs = self.block_size(model, names)
            if len(self._plans) > 4096:  # many models x candidate sets: stay bounded
                self._plans.clear()
            plan = self._plans[key] = _Plan(
                version,
                base,
                lora,
                bs,
                self._encoding(model, base, bs),
                self._max_len(model, names),
            )
        return plan

    def _max_len(self, model: str, pods: Sequence[str]) -> int | None:
        if model in self.settings.max_model_len:
            return self.settings.max_model_len[model]
        if self.scraper is not None:
            return self.scraper.model_max_len(model, pods)
        return None

    async def _encode(
        self,
        kind: Kind,
        body: Mapping[str, Any],
        prompt: Any,
        entry: _Encoding,
        lora: str | None,
    ) -> EncodedPrompt:
        """``prompt``: the validated messages (chat), :func:`_first_prompt` (completion)
        or :func:`router.decision.responses.to_chat`'s messages (responses, whose ``body`` is then
        the chat body of its tools and template kwargs).  A local tokenizer on a short
        prompt runs inline (no coroutine, no thread)."""
        encoder = entry.encoder
        salt = body.get("cache_salt")
        cache_salt = salt if isinstance(salt, str) and salt else None
        t0 = _perf()
        try:
            if kind == "responses":  # messages and chat-format tools from to_chat
                kwargs = body.get("chat_template_kwargs")
                return await encoder.aencode_responses(
                    prompt,
                    tools=body.get("tools"),
                    chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                    lora=lora,
                    cache_salt=cache_salt,
                )
            if kind == "chat":
                tools = body.get("tools")
                if tools is not None and not isinstance(tools, list):
                    raise bad_request("'tools' must be a list", "invalid_tools", param="tools")
                kwargs = body.get("chat_template_kwargs")
                if kwargs is not None and not isinstance(kwargs, dict):
                    raise bad_request(
                        "'chat_template_kwargs' must be an object",
                        "invalid_chat_template_kwargs",
                        param="chat_template_kwargs",
                    )
                agp = body.get("add_generation_prompt", True)
                if body.get("continue_final_message"):
                    agp = False
                return await encoder.aencode_chat(
                    prompt,
                    tools=tools,
                    add_generation_prompt=bool(agp),
                    chat_template_kwargs=kwargs,
                    lora=lora,
                    cache_salt=cache_salt,
                )
            if isinstance(prompt, list):  # token ids: nothing to tokenize
                ids = list(prompt)
                keys = encoder.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
                return EncodedPrompt(ids, keys)
            return await encoder.aencode_prompt(prompt, lora=lora, cache_salt=cache_salt)
        except TokenizeError as exc:
            raise bad_request(f"cannot tokenize the request: {exc}", "tokenize_failed") from None
        finally:
            entry.hist.observe(_perf() - t0)

    # -- the path ----------------------------------------------------------------------

    async def decide(self, kind: Kind, body: dict[str, Any], headers: Mapping[str, str]) -> Routed:
        """Validate, tokenize, look up and pick; raises RouterError (already counted)."""
        try:
            return await self._decide(kind, body, headers)
        except RouterError as err:
            raise self.reject(err) from None

    async def _decide(self, kind: Kind, body: dict[str, Any], headers: Mapping[str, str]) -> Routed:
        """:meth:`decide` before counting a rejection."""
        t0 = _perf()
        model = body.get("model")
        if not isinstance(model, str) or not model:
            model = self._only_model(kind, model)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", "invalid_stream", param="stream")
        prompt: Any = None
        if kind == "chat":
            prompt = _check_messages(body.get("messages"))
        elif kind == "completion":
            prompt = _first_prompt(body.get("prompt"))
        pods = self._candidates(model)
        names = [p.name for p in pods]
        request_id = headers.get("x-request-id") or self._next_id()
        session = headers.get(self.settings.session_header) or body.get("user")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")

        if kind == "embedding" or kind == "passthrough":
            return await self._decide_least_loaded(kind, body, model, stream, pods, request_id)
        encode_body = body
        if kind == "responses":
            pre = await self._responses(body, model, stream, pods, request_id)
            if isinstance(pre, Routed):
                return pre
            prompt, encode_body = pre
            max_tokens = body.get("max_output_tokens")

        plan = self._plan(model, pods, names)
        base, lora, bs, entry = plan.base, plan.lora, plan.block_size, plan.encoding
        if kind == "completion" and type(prompt) is str and entry.encoder.inline_prompt(prompt):
            # the common completion: a local tokenizer, inline (what _encode does, minus
            # its coroutine)
            salt = body.get("cache_salt")
            t_tok = _perf()
            try:
                enc = entry.encoder.encode_prompt(
                    prompt, lora=lora, cache_salt=salt if isinstance(salt, str) and salt else None
                )
            except TokenizeError as exc:
                raise bad_request(
                    f"cannot tokenize the request: {exc}", "tokenize_failed"
                ) from None
            finally:
                entry.hist.observe(_perf() - t_tok)
        else:
            enc = await self._encode(kind, encode_body, prompt, entry, lora)
        ids, keys = enc.token_ids, enc.block_keys
        max_len = plan.max_len
        if max_len is not None and len(ids) > max_len:
            raise bad_request(
                f"this model's maximum context length is {max_len} tokens, but the prompt has "
                f"{len(ids)} tokens",
                "context_length_exceeded",
                param={"chat": "messages", "responses": "input"}.get(kind, "prompt"),
            )
        if enc.approximate:
            self.metrics.child(self.metrics.approximate_tokenizations, model).inc()
        route = RouteRequest(
            request_id,
            model,
            len(ids),
            keys,
            bs,
            lora,
            str(session) if session is not None else None,
            max_tokens if isinstance(max_tokens, int) else None,
        )
        lookup_now = self._lookup_now
        if lookup_now is not None and self._local_load is not None:
            views = self._views_now(lookup_now(keys, names) if keys else {}, names)
        else:
            views = await self._views(keys, names)
        decision = self.policy.pick(route, list(views.values()))
        ranking = _rank(decision, names)
        self._decision_hist.observe(_perf() - t0)
        if self.on_routed is not None and keys and not enc.approximate:
            salt = body.get("cache_salt")
            try:
                self.on_routed(
                    base,
                    ids,
                    bs,
                    keys,
                    lora=lora,
                    cache_salt=salt if isinstance(salt, str) and salt else None,
                )
            except Exception as exc:  # never fails the request
                log.debug("engine-hash learn hook: %s", exc)
        return Routed(
            kind,
            body,
            model,
            stream,
            route,
            decision,
            ranking,
            views,
            entry.name,
            enc.approximate,
        )

    async def _views(self, keys: Sequence[int], names: list[str]) -> dict[str, PodView]:
        hits = await self.index.lookup(keys, names) if keys else {}
        load = await self.load.snapshot(names)
        return self._merge_views(hits, load, names)

    def _views_now(
        self, hits: Mapping[str, Mapping[str, int]], names: list[str]
    ) -> dict[str, PodView]:
        """:meth:`_views` for an in-memory index and load store: no awaits (and no
        snapshot: the store's counts are read directly)."""
        local = self._local_load
        assert local is not None
        inflight_of, prefill_of = local.counts()
        return self._build_views(hits, names, inflight_of, prefill_of, None)

    def _merge_views(
        self,
        hits: Mapping[str, Mapping[str, int]],
        load: Mapping[str, tuple[int, int]],
        names: list[str],
    ) -> dict[str, PodView]:
        # the pending overlay (read after the awaits) only ever holds anything with a
        # shared store: the proxy updates a local one synchronously
        pending = self.pending.get if self._local_load is None else None
        return self._build_views(
            hits,
            names,
            lambda pod, _: load.get(pod, _NO_LOAD)[0],
            lambda pod, _: load.get(pod, _NO_LOAD)[1],
            pending,
        )

    def _build_views(
        self,
        hits: Mapping[str, Mapping[str, int]],
        names: list[str],
        inflight_of: Callable[[str, int], int],
        prefill_of: Callable[[str, int], int],
        pending: Callable[[str], tuple[int, int]] | None,
    ) -> dict[str, PodView]:
        """One view per candidate: index hits, router-tracked load (plus the pending
        overlay), fresh scraped metrics, and how many blocks its cache holds."""
        scraper = self.scraper
        scraped_of = scraper.fresh() if scraper is not None else None
        resident_of = self._resident_blocks().get
        views: dict[str, PodView] = {}
        for name in names:
            inflight = inflight_of(name, 0)
            prefill = prefill_of(name, 0)
            if pending is not None:
                p_n, p_tokens = pending(name)
                inflight += p_n
                prefill += p_tokens
            held = hits.get(name)
            scraped = scraped_of(name) if scraped_of is not None else None
            views[name] = PodView(
                name,
                dict(held) if held else {},
                inflight,
                prefill,
                None if scraped is None else scraped.waiting,
                None if scraped is None else scraped.running,
                None if scraped is None else scraped.kv_usage,
                resident_of(name, 0),
                None if scraped is None else scraped.capacity_blocks,
            )
        return views

    def _resident_blocks(self) -> Mapping[str, int]:
        """Index entries per pod (what each pod's cache holds): from an in-memory index
        at most :data:`RESIDENT_STALE_S` old; for Redis the app's periodic count
        (:attr:`resident`)."""
        entries = self._entries_now
        if entries is not None:
            now = _monotonic()
            if now - self._resident_at > RESIDENT_STALE_S:
                self._resident_at = now
                self.resident = entries()
        return self.resident

    def _only_model(self, kind: Kind, model: Any) -> str:
        """The model of a body without one: a passthrough or Responses request
        (``/tokenize``, ``/v1/responses`` and the like, where vLLM makes ``model``
        optional) goes to the one model served."""
        if (kind == "passthrough" or kind == "responses") and model is None:
            served = self.registry.served_models()
            if len(served) == 1:
                return next(iter(served))
            raise bad_request(
                f"'model' is required: {len(served)} models are served", "missing_model", "model"
            )
        raise bad_request("'model' is required and must be a string", "missing_model", "model")

    # -- the Responses API -------------------------------------------------------------

    async def _responses(
        self,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
    ) -> Routed | tuple[list[dict[str, Any]], dict[str, Any]]:
        """A ``/v1/responses`` body: a follow-up goes to the pod owning its
        ``previous_response_id`` (a decided :class:`Routed`); a new response that
        converts exactly to chat -> (messages, the chat body to encode); anything else is
        routed least-loaded and counted as unscored."""
        inp = body.get("input")
        if not isinstance(inp, (str, list)):
            raise bad_request(
                "'input' is required: a string or a list of input items", "invalid_input", "input"
            )
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise bad_request(
                    "'previous_response_id' must be a string",
                    "invalid_previous_response_id",
                    "previous_response_id",
                )
            owner = await self._owner(previous)
            m = self.metrics
            if owner is not None and any(p.name == owner for p in pods):
                m.child(m.responses_affinity, "owner").inc()
                return await self._decide_owner(body, model, stream, owner, request_id)
            m.child(m.responses_affinity, "unknown" if owner is None else "owner_gone").inc()
            # the history lives on a pod we cannot reach: no exact prompt to score (the
            # pod answers 404, which is relayed)
            reason = "previous_response_id"
            return await self._unscored(reason, body, model, stream, pods, request_id)
        try:
            form = to_chat(body)
        except Unscored as why:
            return await self._unscored(why.reason, body, model, stream, pods, request_id)
        chat_body: dict[str, Any] = {"tools": form.tools}
        for key in ("chat_template_kwargs", "cache_salt"):
            if key in body:
                chat_body[key] = body[key]
        return form.messages, chat_body

    async def _owner(self, response_id: str) -> str | None:
        """The pod that created ``response_id`` (None: not known to the owner store)."""
        if self.owners is None:
            return None
        try:
            return await self.owners.get(response_id)
        except Exception as exc:  # the store is down: route as if unknown
            log.warning("response owner lookup failed: %r", exc)
            self.metrics.child(self.metrics.responses_affinity, "store_error").inc()
            return None

    async def owner_of(self, response_id: str) -> str:
        """The registered pod that created ``response_id`` (GET, cancel); 404 when the
        router knows no owner, or its pod left (counted)."""
        m = self.metrics
        owner = await self._owner(response_id)
        if owner is not None and self.registry.get(owner) is not None:
            m.child(m.responses_affinity, "owner").inc()
            return owner
        m.child(m.responses_affinity, "unknown" if owner is None else "owner_gone").inc()
        why = "is not known to the router" if owner is None else f"was stored on pod {owner}, gone"
        raise self.reject(
            RouterError(
                404,
                f"Response with id '{response_id}' not found: it {why}",
                reason="response_not_found",
                param="response_id",
            )
        )

    async def _unscored(
        self,
        reason: str,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
    ) -> Routed:
        self.metrics.child(self.metrics.responses_unscored, reason).inc()
        return await self._decide_least_loaded("responses", body, model, stream, pods, request_id)

    async def _decide_owner(
        self, body: dict[str, Any], model: str, stream: bool, owner: str, request_id: str
    ) -> Routed:
        """A follow-up: only the owner (any other pod answers 404, so no retry there)."""
        views = await self._views((), [owner])
        return _without_prompt(
            "responses",
            body,
            model,
            stream,
            request_id,
            [owner],
            {owner: 0.0},
            views,
            {"affinity": "owner"},
        )

    async def _decide_least_loaded(
        self,
        kind: Kind,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
    ) -> Routed:
        """Embeddings and passthrough requests: no prefix to follow (an embedding leaves
        no reusable KV cache), so least in-flight, ties rotated."""
        names = [p.name for p in pods]
        views = await self._views((), names)
        self._rr += 1
        order = sorted(
            range(len(names)),
            key=lambda i: (views[names[i]].inflight, (i - self._rr) % len(names)),
        )
        ranking = [names[i] for i in order]
        scores = {n: float(views[n].inflight) for n in names}
        return _without_prompt(kind, body, model, stream, request_id, ranking, scores, views)


def _without_prompt(
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


def _rank(decision: Decision, names: Sequence[str]) -> list[str]:
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


def explain(routed: Routed, registry: PodRegistry, policy: str) -> dict[str, Any]:
    """The body of ``POST /v1/route``."""
    scores = routed.decision.scores
    candidates = []
    for pod in routed.ranking:
        v = routed.views[pod]
        state = registry.get(pod)
        candidates.append(
            {
                "pod": pod,
                "url": state.spec.url if state else None,
                "cached_blocks": dict(v.hits),
                "cached_tokens": routed.cached_tokens(pod),
                "inflight": v.inflight,
                "outstanding_prefill_tokens": v.outstanding_prefill_tokens,
                "waiting": v.waiting,
                "running": v.running,
                "kv_usage": v.kv_usage,
                "resident_blocks": v.resident_blocks,
                "capacity_blocks": v.capacity_blocks,
                "score": scores.get(pod),
            }
        )
    return {
        "pod": routed.decision.pod,
        "policy": policy,
        "model": routed.model,
        "lora": routed.route.lora,
        "prompt_tokens": routed.route.prompt_tokens,
        "block_size": routed.route.block_size,
        "blocks": len(routed.route.block_keys),
        "tokenizer": routed.tokenizer_name,
        "approximate": routed.approximate,
        "lower_is_better": routed.decision.lower_is_better,
        "candidates": candidates,
        "detail": routed.decision.detail,
    }
