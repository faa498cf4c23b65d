"""What the request path derives from a model and its candidate pods: the base model
and LoRA adapter, the block size, the encoder and the maximum prompt length.

The LoRA rule: a ``model`` that is not a pod's base model is an adapter; its block keys
are chained from the base model's root with the adapter name folded into every block
(as the indexer does with the events' ``lora_name``).  A :class:`Plan` is kept while the
fleet and the scraped values it was derived from are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from router.config import Settings
from router.fleet.pods import PodRegistry, PodState
from router.fleet.scrape import MetricsScraper
from router.metrics import RouterMetrics
from router.tokenize import ChatEncoder, PromptTokenizer
from scoring.blocks import BlockHasher

DEFAULT_BLOCK_SIZE = 16


class Encoding:
    """A model's encoder with what the request path needs of it, looked up once."""

    __slots__ = ("encoder", "hist", "name")

    def __init__(self, encoder: ChatEncoder, name: str, hist: Any) -> None:
        self.encoder = encoder
        #: the tokenizer's name (metrics label, /v1/route)
        self.name = name
        #: its child of kvroute_tokenization_seconds
        self.hist = hist


class Plan:
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
        encoding: Encoding,
        max_len: int | None,
    ) -> None:
        self.version = version
        self.base = base
        self.lora = lora
        self.block_size = block_size
        self.encoding = encoding
        self.max_len = max_len


class Planner:
    """:class:`Plan` per (model, candidate set), cached by fleet and scrape version."""

    def __init__(
        self,
        settings: Settings,
        registry: PodRegistry,
        scraper: MetricsScraper | None,
        tokenizer_for: Callable[[str], PromptTokenizer],
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.scraper = scraper
        self.tokenizer_for = tokenizer_for
        self.metrics = metrics
        self._encoders: dict[tuple[int, str, int], Encoding] = {}
        self._plans: dict[tuple[str, ...], Plan] = {}

    def base_and_lora(self, model: str, pods: Sequence[PodState]) -> tuple[str, str | None]:
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

    def encoding(self, model: str, base: str, block_size: int) -> Encoding:
        tok = self.tokenizer_for(model)
        key = (id(tok), base, block_size)
        entry = self._encoders.get(key)
        if entry is None:
            encoder = ChatEncoder(tok, BlockHasher(block_size, base))
            name = getattr(tok, "name", "unknown")
            m = self.metrics
            entry = self._encoders[key] = Encoding(encoder, name, m.tokenize_seconds.labels(name))
        return entry

    def plan(self, model: str, pods: Sequence[PodState], names: list[str]) -> Plan:
        """:meth:`base_and_lora`, :meth:`block_size`, :meth:`encoding` and
        :meth:`max_len` for ``model`` on ``names``, recomputed when the fleet or the
        scraped values changed."""
        version = (self.registry.version, self.scraper.version if self.scraper else 0)
        key = (model, *names)
        plan = self._plans.get(key)
        if plan is None or plan.version != version:
            base, lora = self.base_and_lora(model, pods)
            bs = self.block_size(model, names)
            if len(self._plans) > 4096:  # many models x candidate sets: stay bounded
                self._plans.clear()
            plan = self._plans[key] = Plan(
                version,
                base,
                lora,
                bs,
                self.encoding(model, base, bs),
                self.max_len(model, names),
            )
        return plan

    def max_len(self, model: str, pods: Sequence[str]) -> int | None:
        if model in self.settings.max_model_len:
            return self.settings.max_model_len[model]
        if self.scraper is not None:
            return self.scraper.model_max_len(model, pods)
        return None
