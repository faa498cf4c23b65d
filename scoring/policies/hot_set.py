"""The hot working set a router has sent to each pod, and what it means for room.

A pod's KV cache holds three kinds of blocks: blocks held by running requests (vLLM's
``kv_cache_usage_perc``), cached blocks that requests will soon reuse (the *hot* ones:
the next turn of a conversation in progress, a shared system prompt), and cached
blocks nobody will ask for again (*cold*: old traffic, or prompts sent to the pod by
someone else).  vLLM evicts unreferenced blocks LRU, so a new prefix placed on a pod
costs nothing when it displaces cold blocks and costs a recompute per hot block it
displaces.

The engine's counters cannot tell hot from cold; the router can, for what it routed:
:class:`HotBlocks` remembers, per pod, the block keys of the requests routed there in
the last ``window_s`` seconds (each key once, with the time it was last routed).  That
count is a lower bound of the pod's hot set (other routers' traffic is not in it).

* :func:`room` — free blocks for a new prefix: ``min(free_blocks(view), capacity -
  hot)``: a block is taken when a running request holds it (vLLM) or when this router
  sent it there within the window; cold cache is free.
* :meth:`HotBlocks.surviving` — the leading blocks of a cached prefix an LRU cache of
  ``capacity`` blocks keeps, by this router's traffic: block ``i`` stays while ``i`` +
  the distinct blocks routed to the pod after it was last routed there stay under the
  capacity (vLLM evicts LRU, a freed request's tail first).
* :func:`evicted_hot` — the hot blocks a request's uncached blocks would push out of a
  pod: ``clamp(hot + new - capacity, 0, new)``.  Each is a miss some later request pays.

``window_s`` defaults to 300 s: the lifetime hosted LLM APIs give an unused cached
prefix (Anthropic's prompt cache lives 5 minutes, refreshed on each use; OpenAI's docs
say cached prefixes stay active for 5 to 10 minutes of inactivity) — their estimate of
how long a prefix stays worth keeping, not a number measured here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from scoring.policies.base import PodView
from scoring.policies.inflight import agree_until
from scoring.policies.room import free_blocks

#: a pod's remembered keys are bounded (memory) when its capacity is unknown
MAX_KEYS_PER_POD = 1 << 20
_INF = float("inf")


class _Node:
    """A run of consecutive block positions ``[start, end)`` that the same routed
    chains pass through, read from ``chain`` (one of them).  ``time``: when a chain
    through it was last routed (a node's time is at least its children's)."""

    __slots__ = ("chain", "children", "end", "parent", "start", "time")

    def __init__(
        self, chain: Sequence[int], start: int, end: int, time: float, parent: _Node | None
    ) -> None:
        self.chain = chain
        self.start = start
        self.end = end
        self.time = time
        self.parent = parent
        self.children: dict[int, _Node] = {}


class _PodTree:
    """One pod's routed chains as a radix tree of block positions, with the number of
    distinct positions (= distinct keys) it holds and its nodes in the order they were
    last refreshed (one entry a node: memory grows with the tree, not the traffic)."""

    __slots__ = ("keys", "limit", "next_expiry", "order", "root")

    def __init__(self) -> None:
        self.root = _Node((), 0, 0, _INF, None)
        self.keys = 0
        self.limit = MAX_KEYS_PER_POD
        self.order: OrderedDict[_Node, None] = OrderedDict()
        self.next_expiry = _INF

    def insert(self, keys: Sequence[int], now: float) -> None:
        node, i, n = self.root, 0, len(keys)
        order = self.order
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                leaf = node.children[keys[i]] = _Node(keys, i, n, now, node)
                self.keys += n - i
                order[leaf] = None
                return
            end = child.end if child.end <= n else n
            # (agree_until's first test inlined: a repeated prefix passes it)
            m = (
                end
                if child.chain[end - 1] == keys[end - 1]
                else agree_until(child.chain, keys, i, end)
            )
            if m < child.end:  # the chain leaves (or ends inside) the child's run: split
                head = _Node(child.chain, i, m, now, node)
                node.children[keys[i]] = head
                child.start = m
                child.parent = head
                head.children[child.chain[m]] = child
                order[head] = None
                if m < n:
                    leaf = head.children[keys[m]] = _Node(keys, m, n, now, head)
                    self.keys += n - m
                    order[leaf] = None
                return
            child.time = now
            order.move_to_end(child)
            if m < n and not child.children:  # a prompt extending a leaf (a next turn)
                child.chain, child.end = keys, n  # grows the leaf: the tree stays shallow
                self.keys += n - m
                return
            node, i = child, m

    def drop(self, node: _Node, under: list[_Node] | None = None) -> None:
        """Detach ``node`` and everything under it (all at most as recent as it;
        ``under``: :func:`_subtree` of it, when already listed)."""
        parent = node.parent
        if parent is not None:
            del parent.children[node.chain[node.start]]
        order = self.order
        for x in _subtree(node) if under is None else under:
            del order[x]
            self.keys -= x.end - x.start


def _subtree(node: _Node) -> list[_Node]:
    """``node`` and every node under it."""
    out, stack = [], [node]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


class HotBlocks:
    """Per pod: the distinct block keys routed there in the last ``window_s`` seconds.

    Block keys are chains, so a pod's routed prompts form a radix tree of block
    positions (SGLang keeps its prefix cache in one).  :meth:`routed` walks the tree
    along the prompt, refreshing the nodes it passes and splitting at most one: its cost
    grows with the number of branch points on the way, not with the prompt's blocks.
    Nodes leave when their time falls out of the window (a node is never older than
    its children, so a whole subtree leaves at once).  :meth:`count` is a comparison
    with the time the pod's oldest node leaves the window until that time passes."""

    def __init__(self, window_s: float, max_keys: int = MAX_KEYS_PER_POD) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._pods: dict[str, _PodTree] = {}

    def routed(
        self, pod: str, keys: Sequence[int], now: float, capacity: int | None = None
    ) -> None:
        """``keys`` were routed to ``pod`` at ``now``.  With the pod's ``capacity``
        known, only the most recent ``2 * capacity`` keys count: a pod whose hot set
        is twice its cache has no room and evicts a hot block per new one either way."""
        tree = self._pods.get(pod)
        if tree is None:
            tree = self._pods[pod] = _PodTree()
        tree.insert(keys, now)
        limit = self.max_keys
        if capacity is not None and 2 * capacity < limit:
            limit = 2 * capacity
        tree.limit = limit
        # drop the least recent subtrees while what stays is at least the bound, so
        # that the count below is the bound either way and memory stays bounded
        order = tree.order
        while order and tree.keys > limit:
            node = next(iter(order))  # the least recently refreshed
            under = _subtree(node)
            if tree.keys - sum(x.end - x.start for x in under) < limit:
                break
            tree.drop(node, under)
        # nothing leaves before the oldest node's time does: next_expiry is a lower
        # bound of it (an insert only refreshes nodes), unless the tree was empty
        if not now < tree.next_expiry < _INF:
            self._expire(tree, now)

    def count(self, pod: str, now: float) -> int:
        """Distinct keys routed to ``pod`` within the window before ``now``, at most
        the bound of its last :meth:`routed`."""
        tree = self._pods.get(pod)
        if tree is None:
            return 0
        if now >= tree.next_expiry:
            self._expire(tree, now)
        n = tree.keys
        return n if n <= tree.limit else tree.limit

    def routed_keys(self, pod: str) -> int:
        """Distinct keys routed to ``pod`` that the tree holds (an upper bound of
        :meth:`count`: no expiry is applied; all of them fit beside a prefix of ``n``
        blocks when it is at most ``capacity - n``)."""
        tree = self._pods.get(pod)
        return 0 if tree is None else tree.keys

    def surviving(
        self, pod: str, keys: Sequence[int], cached: int, now: float, capacity: int
    ) -> int:
        """How many of the ``cached`` leading blocks of ``keys`` on ``pod`` an LRU cache
        of ``capacity`` blocks keeps, by this router's traffic: block ``i`` stays while
        ``i`` + the keys routed there more recently than it (its own node's time), less
        the prompt's own, stay under ``capacity``.  A block routed again since (a shared
        instruction every request carries) is as recent as that; a request's blocks go
        tail first (vLLM frees them so).  Blocks past the routed path: after the end of a
        routed chain (a leaf, covered whole), that request's own continuation (its
        answer, cached as the pod decoded it, which a chat's next turn carries), as
        recent as the chain; anywhere else (the prefix leaves routed chains where they
        go on, or was never routed here), older than every routed key.  One walk of the
        pod's nodes from the most recently refreshed back to the prefix's deepest."""
        tree = self._pods.get(pod)
        n = min(cached, len(keys))
        if tree is None or n <= 0:
            return n
        if now >= tree.next_expiry:
            self._expire(tree, now)
        shared, last = _path(tree, keys, n)
        routed = sum(shared.values())
        first_out = n  # the first block that does not stay
        if last is None:
            tip = next(reversed(shared), None)
            if tip is None or tip.children or shared[tip] < tip.end - tip.start:
                # past the routed path: older than every routed key
                first_out = max(routed, capacity - (tree.keys - routed))
                if first_out >= n:
                    first_out = n
            else:
                last = tip  # its continuation (the answer) is as recent as it
        pending = {y for y, v in shared.items() if v > 0}
        newer = 0  # keys off the path routed strictly after the current node's time
        run_t, run = _INF, 0  # the current time, and its keys off the path so far
        for x in reversed(tree.order):  # refresh order: times never decrease along it
            if x.time != run_t:
                newer += run
                run_t, run = x.time, 0
                if newer >= capacity:  # every path node left is out from its first block
                    for y in pending:
                        if y.start < first_out:
                            first_out = y.start
                    return first_out
            on_path = shared.get(x, 0)
            if on_path:
                end = n if x is last else x.start + on_path
                out = capacity - newer
                if out < x.start:
                    out = x.start
                if out < end and out < first_out:
                    first_out = out
                pending.discard(x)
                if not pending:
                    return first_out
            run += x.end - x.start - on_path
        return first_out

    def prefix(self, pod: str, keys: Sequence[int], now: float) -> int:
        """The leading blocks of ``keys`` routed to ``pod`` within the window (the
        longest routed prefix: what this router would expect the pod to hold)."""
        tree = self._pods.get(pod)
        if tree is None:
            return 0
        if now >= tree.next_expiry:
            self._expire(tree, now)
        return sum(_path(tree, keys, len(keys))[0].values())

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)

    def _expire(self, tree: _PodTree, now: float) -> None:
        horizon = now - self.window_s
        order = tree.order
        while order:
            node = next(iter(order))
            if node.time >= horizon:
                tree.next_expiry = node.time + self.window_s
                return
            tree.drop(node)
        tree.next_expiry = _INF


def _path(tree: _PodTree, keys: Sequence[int], n: int) -> tuple[dict[_Node, int], _Node | None]:
    """The nodes on the path of ``keys[:n]`` with the blocks of it each holds, and the
    node holding its last block (None when the tree holds fewer than ``n``)."""
    node, i = tree.root, 0
    shared: dict[_Node, int] = {}
    while i < n:
        child = node.children.get(keys[i])
        if child is None:
            break
        end = child.end if child.end <= n else n
        m = agree_until(child.chain, keys, i, end)
        shared[child] = m - child.start
        if m >= n:
            return shared, child
        if m < child.end:
            break
        node, i = child, m
    return shared, None


def room(view: PodView, hot: int) -> float | None:
    """Free blocks for a new prefix on ``view``'s pod: vLLM's free blocks less the hot
    ones this router routed there (``None`` when the pod's free room is unknown)."""
    free = free_blocks(view)
    if free is None or view.capacity_blocks is None:
        return free
    return min(free, float(view.capacity_blocks - hot))


def evicted_hot(hot: int, new: int, capacity: int | None) -> int:
    """Hot blocks that ``new`` freshly computed blocks push out of a pod whose hot set
    is ``hot`` blocks and cache ``capacity`` blocks (0 when the capacity is unknown)."""
    if capacity is None or new <= 0:
        return 0
    over = hot + new - capacity
    return 0 if over <= 0 else min(over, new)


def most_room(
    tied: Sequence[PodView],
    hot: HotBlocks | None = None,
    now: float = 0.0,
    cached: Mapping[str, int] | None = None,
    counted: Mapping[str, int] | None = None,
) -> list[str]:
    """The names of the tied pods with the most room for a new prefix (:func:`room`:
    vLLM's free blocks less the blocks ``hot`` says this router sent there within its
    window, read at ``now``) when every tied pod has it.  Else (a pod whose cache size
    is unknown) nothing says where a copy of the prefix would have room, so a copy is
    not made: the tie narrows to the pods ``cached`` says hold the most of the prompt
    (when one holds some), then to the fewest resident blocks (all of them when a tied
    pod's count is unknown).

    :func:`room` inlined (one pass, hot counts read only here unless ``counted`` has
    them: ``hot``'s counts at ``now`` the caller read already): it runs on every
    decision whose candidates tie, the usual case for a prefix no pod holds."""
    most = -_INF
    names: list[str] = []
    count = hot.count if hot is not None else None
    for v in tied:
        cap = v.capacity_blocks
        if cap is None:
            break
        usage = v.kv_usage
        if usage is not None and -_INF < usage < _INF:  # free_blocks (NaN fails both)
            free = cap * (1.0 - (1.0 if usage > 1.0 else usage if usage > 0.0 else 0.0))
        elif v.resident_blocks is not None:
            free = float(cap - v.resident_blocks)
        else:
            break
        if count is not None:
            h = counted.get(v.pod) if counted is not None else None
            left = cap - (count(v.pod, now) if h is None else h)
            if left < free:
                free = float(left)
        if free > most:
            most = free
            names = [v.pod]
        elif free == most:
            names.append(v.pod)
    else:
        return names
    if cached is not None:
        top = max([cached.get(v.pod, 0) for v in tied])
        if top > 0:
            tied = [v for v in tied if cached.get(v.pod, 0) == top]
            if len(tied) == 1:
                return [tied[0].pod]
    least = None
    for v in tied:
        if v.resident_blocks is None:
            return [v.pod for v in tied]
        if least is None or v.resident_blocks < least:
            least = v.resident_blocks
    return [v.pod for v in tied if v.resident_blocks == least]
