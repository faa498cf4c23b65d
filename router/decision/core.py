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
(:mod:`.request`), the candidates (:mod:`.candidates`), the model's plan (:mod:`.plan`:
base model, adapter, block size, encoder), the tokenizing (:mod:`.encode`), the
candidates' views (:mod:`.views`), the decisions that score no prompt (:mod:`.unscored`:
Responses follow-ups, embeddings, passthroughs), the Responses API's rules
(:mod:`.responses`) and ``POST /v1/route``'s explanation (:mod:`.explain`).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from router.config import Settings
from router.decision.candidates import candidates, only_model
from router.decision.disagg import PDStep
from router.decision.encode import encode, encode_now
from router.decision.learning import RouteLearner
from router.decision.owners import OwnerStore
from router.decision.plan import Planner
from router.decision.request import (
    Kind,
    Routed,
    check_messages,
    first_prompt,
    rank,
)
from router.decision.unscored import UnscoredRoutes
from router.decision.views import ViewBuilder
from router.errors import RouterError, bad_request
from router.fleet.load import LoadStore, PendingLoad
from router.fleet.pods import PodRegistry
from router.fleet.scrape import MetricsScraper
from router.metrics import RouterMetrics
from router.tokenize import PromptTokenizer
from scoring.index.base import BlockIndex
from scoring.policies.base import Policy, RouteRequest

log = logging.getLogger(__name__)

_perf = time.perf_counter


class RequestRouter(UnscoredRoutes):
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
        self.views = ViewBuilder(
            index,
            load,
            scraper,
            self.pending,
            learner,
            fallback=lambda keys, names: self.policy.routed_prefixes(keys, names),
        )
        #: prefill/decode: decides for models whose pods have roles (none: the policy)
        self.pd = PDStep(settings.pd, settings.policy, settings.policy_params)
        #: whether any pod of the fleet has a P/D role, for the registry version it was
        #: read at (a fleet without roles skips the P/D step at the cost of one compare)
        self._roles_at = -1
        self._any_roles = False
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
            model = only_model(self.registry, kind, model)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", "invalid_stream", param="stream")
        prompt: Any = None
        if kind == "chat":
            prompt = check_messages(body.get("messages"))
        elif kind == "completion":
            prompt = first_prompt(body.get("prompt"))
        pods = candidates(self.registry, model, only)
        names = [p.spec.name for p in pods]
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
            enc = encode_now(entry, prompt, lora, body)
        else:
            enc = await encode(kind, encode_body, prompt, entry, lora)
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
        pd = self.pd.plan(route, pods, views) if self._fleet_has_roles() else None
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

    def _fleet_has_roles(self) -> bool:
        """Any pod with a P/D role (``role`` or per-model ``roles``), re-read only when
        the fleet changed (a role is part of the pod's spec)."""
        registry = self.registry
        if self._roles_at != registry.version:
            self._roles_at = registry.version
            self._any_roles = any(p.spec.role != "both" or p.spec.roles for p in registry.all())
        return self._any_roles

    def sent(self, routed: Routed, pod: str) -> None:
        """The front is sending ``routed`` to ``pod`` (each attempt; never for
        ``/v1/route``): the learner writes the chain of a learning pod."""
        learner = self.learner
        if learner is not None and learner.enabled:
            try:
                learner.on_sent(routed, pod)
            except Exception as exc:  # never fails the request
                log.warning("speculative entries: %s", exc)
