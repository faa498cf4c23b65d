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

The pieces live beside this module: the body's checks and the decided request
(:mod:`.request`), the model's plan (:mod:`.plan`: base model, adapter, block size,
encoder), the candidates' views (:mod:`.views`), the Responses API's rules
(:mod:`.responses`) and ``POST /v1/route``'s explanation (:mod:`.explain`).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from router.config import Settings
from router.decision.disagg import PDStep
from router.decision.learning import RouteLearner
from router.decision.owners import OwnerStore
from router.decision.plan import Encoding, Planner
from router.decision.request import (
    Kind,
    Routed,
    check_messages,
    first_prompt,
    rank,
    without_prompt,
)
from router.decision.responses import Unscored, to_chat
from router.decision.views import ViewBuilder
from router.errors import RouterError, bad_request
from router.fleet.load import LoadStore, PendingLoad
from router.fleet.pods import PodRegistry, PodState
from router.fleet.scrape import MetricsScraper
from router.logs import RateLimitedLog
from router.metrics import RouterMetrics
from router.tokenize import EncodedPrompt, PromptTokenizer, TokenizeError
from scoring.index.base import BlockIndex
from scoring.policies.base import Policy, RouteRequest

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)  # per-request warnings: one line per cause per 10 s

_perf = time.perf_counter


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
        learner: RouteLearner | None = None,
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
        self.planner = Planner(settings, registry, scraper, tokenizer_for, metrics)
        #: speculative entries: pods learned from the requests sent to them
        self.learner = learner
        self.views = ViewBuilder(index, load, scraper, self.pending, learner)
        #: prefill/decode: decides for models whose pods have roles (none: the policy)
        self.pd = PDStep(settings.pd, settings.policy, settings.policy_params)
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

    def _candidates(self, model: str, only: Collection[str] | None = None) -> list[PodState]:
        pods = self.registry.candidates(model)
        if pods and only is not None:  # a front's restriction (an endpoint picker's subset hint)
            pods = [p for p in pods if p.name in only]
            if not pods:
                raise RouterError(
                    503,
                    f"no healthy pod serving model {model!r} is among the allowed endpoints",
                    reason="no_pod_in_subset",
                    param="model",
                )
        if pods:
            return pods
        every = self.registry.all()
        if any(model in p.models for p in every):
            raise RouterError(
                503,
                f"no healthy pod serves model {model!r} right now{_why_not(every)}",
                reason="no_healthy_pod",
                param="model",
            )
        if not every:
            raise RouterError(
                503,
                "no pods discovered yet: check the discovery settings (discovery.kind and "
                "its pods, hostname or selector)",
                reason="no_pods",
                param="model",
            )
        if not any(p.models for p in every):  # none has told us what it serves
            raise RouterError(
                503,
                f"none of the {len(every)} pods has reported its models yet{_why_not(every)}",
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

    async def _encode(
        self,
        kind: Kind,
        body: Mapping[str, Any],
        prompt: Any,
        entry: Encoding,
        lora: str | None,
    ) -> EncodedPrompt:
        """``prompt``: the validated messages (chat), :func:`first_prompt` (completion)
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

    async def decide(
        self,
        kind: Kind,
        body: dict[str, Any],
        headers: Mapping[str, str],
        *,
        only: Collection[str] | None = None,
        tenant: str | None = None,
    ) -> Routed:
        """Validate, tokenize, look up and pick; raises RouterError (already counted).
        ``only``: the pods the front allows (None: every candidate); ``tenant``: whose
        request it is (a ``previous_response_id`` must be its own)."""
        try:
            routed = await self._decide(kind, body, headers, only, tenant)
        except RouterError as err:
            raise self.reject(err) from None
        routed.tenant = tenant
        return routed

    async def _decide(
        self,
        kind: Kind,
        body: dict[str, Any],
        headers: Mapping[str, str],
        only: Collection[str] | None = None,
        tenant: str | None = None,
    ) -> Routed:
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
            prompt = check_messages(body.get("messages"))
        elif kind == "completion":
            prompt = first_prompt(body.get("prompt"))
        pods = self._candidates(model, only)
        names = [p.name for p in pods]
        request_id = headers.get("x-request-id") or self._next_id()
        session = headers.get(self.settings.session_header) or body.get("user")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")

        if kind == "embedding" or kind == "passthrough":
            return await self._decide_least_loaded(kind, body, model, stream, pods, request_id)
        encode_body = body
        if kind == "responses":
            pre = await self._responses(body, model, stream, pods, request_id, tenant)
            if isinstance(pre, Routed):
                return pre
            prompt, encode_body = pre
            max_tokens = body.get("max_output_tokens")

        plan = self.planner.plan(model, pods, names)
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
        vb = self.views
        lookup_now = vb.lookup_now
        if lookup_now is not None:
            views = vb.views_now(lookup_now(keys, names) if keys else {}, names, keys)
        else:
            views = await vb.views(keys, names)
        pd = self.pd.plan(route, pods, views)
        if pd is None:  # no roles: the policy over every candidate
            decision = self.policy.pick(route, list(views.values()))
            ranking = rank(decision, names)
        else:
            decision, ranking = pd.as_decision(), pd.decode_ranking
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
            pd=pd,
        )

    def sent(self, routed: Routed, pod: str) -> None:
        """The front is sending ``routed`` to ``pod`` (each attempt; never for
        ``/v1/route``): the learner writes the chain of a learning pod."""
        learner = self.learner
        if learner is not None and learner.enabled:
            try:
                learner.on_sent(routed, pod)
            except Exception as exc:  # never fails the request
                log.warning("speculative entries: %s", exc)

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
        tenant: str | None = None,
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
            owner = await self._owner(previous, tenant)
            m = self.metrics
            if owner is not None and any(p.name == owner for p in pods):
                m.child(m.responses_affinity, "owner").inc()
                return await self._decide_owner(body, model, stream, owner, request_id)
            m.child(m.responses_affinity, "unknown" if owner is None else "owner_gone").inc()
            if owner is None and tenant is not None:
                # not this tenant's (or unknown): never sent on, where the pod holding it
                # would continue another tenant's conversation
                raise _response_not_found(previous, "previous_response_id")
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

    async def _owner(self, response_id: str, tenant: str | None = None) -> str | None:
        """The pod that created ``response_id`` for ``tenant`` (None: not known to the
        owner store, or another tenant's)."""
        if self.owners is None:
            return None
        try:
            return await self.owners.get(response_id, tenant)
        except Exception as exc:  # the store is down: route as if unknown
            _limited.warning("owner_get", "response owner lookup failed: %r", exc)
            self.metrics.child(self.metrics.responses_affinity, "store_error").inc()
            return None

    async def owner_of(self, response_id: str, tenant: str | None = None) -> str:
        """The registered pod that created ``response_id`` (GET, cancel); 404 when the
        router knows no owner (or ``tenant`` did not create it), or its pod left (counted)."""
        m = self.metrics
        owner = await self._owner(response_id, tenant)
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
        views = await self.views.views((), [owner])
        return without_prompt(
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
        views = await self.views.views((), names)
        self._rr += 1
        order = sorted(
            range(len(names)),
            key=lambda i: (views[names[i]].inflight, (i - self._rr) % len(names)),
        )
        ranking = [names[i] for i in order]
        scores = {n: float(views[n].inflight) for n in names}
        return without_prompt(kind, body, model, stream, request_id, ranking, scores, views)


def _response_not_found(response_id: str, param: str) -> RouterError:
    return RouterError(
        404,
        f"Response with id '{response_id}' not found",
        reason="response_not_found",
        param=param,
    )


def _why_not(pods: Sequence[PodState]) -> str:
    """``"; pod-a: <its last problem>"`` for the first pod with a known problem."""
    for p in pods:
        if p.problem:
            return f"; {p.name}: {p.problem}"
    return ""
