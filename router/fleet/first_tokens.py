"""The first tokens this router does not see, live: JSON answers forwarded as they came
(``--no-proxy.stream-json-answers``, or the Endpoint Picker's non-streamed answers).

The proxy and the picker register each such request when it is sent
(:meth:`FirstTokenLedger.expect`), report every first token they do see
(:meth:`FirstTokenLedger.seen`), and the request's :class:`~router.fleet.load.RequestLoad`
reports its end.  Each scrape of a pod hands the ledger the pod's counts of first tokens
and finished requests; the pending requests they show past their first token are
released as at a first token: the load's outstanding prefill ends and the policy hears
``on_prefill_done`` (the rules: scoring/unseen_first_tokens.py).  Counted in
``kvroute_unseen_first_tokens_total``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from scoring.unseen_first_tokens import UnseenFirstTokens

if TYPE_CHECKING:
    from prometheus_client import Counter

    from router.fleet.load import RequestLoad
    from router.fleet.scrape import Scraped
    from scoring.policies.base import Policy, RouteRequest

log = logging.getLogger(__name__)


class Unseen:
    """One request whose first token the router will not see."""

    __slots__ = ("load", "route")

    def __init__(self, load: RequestLoad, route: RouteRequest) -> None:
        self.load = load
        self.route = route


class FirstTokenLedger:
    """Per pod, this router's requests whose first token it will not see (module
    docstring)."""

    def __init__(self, policy: Policy, released: Counter | None = None) -> None:
        self.policy = policy
        self._gap: UnseenFirstTokens[Unseen] = UnseenFirstTokens()
        self._released = released
        self._tasks: set[asyncio.Task[None]] = set()

    def expect(self, load: RequestLoad, route: RouteRequest) -> None:
        """``load``'s request was sent and its first token will not come back here."""
        ticket = Unseen(load, route)
        load.ledger, load.ticket = self, ticket
        self._gap.expect(load.pod, ticket)

    def started(self, pod: str) -> None:
        """A request was sent to ``pod`` (RequestLoad's begin)."""
        self._gap.started(pod)

    def seen(self, pod: str) -> None:
        """A first token came back from ``pod``."""
        self._gap.seen(pod)

    def ended(self, pod: str, ticket: Unseen | None) -> None:
        """A request this router sent to ``pod`` ended (RequestLoad's end)."""
        self._gap.ended(pod, ticket)

    def on_scraped(self, pod: str, scraped: Scraped) -> None:
        """A scrape of ``pod``: release what its counts show past its first token."""
        for ticket in self._gap.scraped(pod, scraped.first_tokens, scraped.finished):
            load = ticket.load
            if load.local is not None:
                load.first_token_now()
            else:  # a shared store: a round trip, off the scrape loop's path
                task = asyncio.get_running_loop().create_task(load.first_token())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self.policy.on_prefill_done(ticket.route, pod)
            if self._released is not None:
                self._released.inc()

    def seen_count(self, pod: str) -> int:
        """First tokens seen on ``pod`` since its count's baseline (its first scrape)."""
        return self._gap.seen_count(pod)

    def forget(self, pod: str) -> None:
        self._gap.forget(pod)
