"""Routing policies: which of several replicas serves a request (SGLang router's policies, by name).

- `cache_aware` (default): the replica holding the longest prefix of the prompt (`PrefixIndex`),
  unless the load is out of balance (the busiest replica has more than `balance_abs_threshold`
  requests over the idlest and more than `balance_rel_threshold` times its load): then the least
  loaded. A prompt matching nowhere goes to the replica that was sent the fewest new (unmatched)
  blocks so far, so that new prefixes spread evenly; one without a full block to the least loaded.
- `least_load`: the replica with the fewest requests running and waiting.
- `round_robin`: in turn.
- `session`: the same replica for the same session key (the request's `user` field or a header),
  by rendezvous hashing, so a key keeps its replica while the set of live replicas stays the same;
  requests without a key go to the least loaded.

Ties go to the replica least recently chosen, so equal loads spread evenly. The router is plain
Python over plain data: the data-parallel front end (`pagoda.engine.replica_set`) and the
standalone router (`pagoda.serve.router_app`) both use it.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.engine.prefix_index import PrefixIndex

ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin", "session")


@dataclass
class RouteDecision:
    """Where a request went and why: shown in its timeline and in the logs."""

    replica: int
    policy: str
    reason: str  # prefix_match, least_cached, least_load, imbalance, round_robin, session, only_replica
    matched_blocks: int = 0
    prompt_blocks: int = 0
    loads: dict[int, int] | None = None
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"event": "routed", "time": self.time, "replica": self.replica, "policy": self.policy, "reason": self.reason,
                "matched_blocks": self.matched_blocks, "prompt_blocks": self.prompt_blocks,
                "loads": {str(k): v for k, v in (self.loads or {}).items()}}


class Router:
    """Chooses a replica among the live ones and keeps the prefix index of what each holds."""

    def __init__(self, policy: str = "cache_aware", balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, index: PrefixIndex | None = None) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.policy = policy
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = index or PrefixIndex()
        self._turn = itertools.count()  # orders choices, for ties
        self._rr = itertools.count()
        self._last_chosen: dict[int, int] = {}
        self._new_blocks: dict[int, int] = {}  # per replica: prompt blocks it was sent that it did not hold

    def _least_loaded(self, loads: dict[int, int], among: Sequence[int] | None = None) -> int:
        among = list(loads) if among is None else among
        return min(among, key=lambda r: (loads[r], self._last_chosen.get(r, -1), r))

    def _imbalanced(self, loads: dict[int, int]) -> bool:
        hi, lo = max(loads.values()), min(loads.values())
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, loads: dict[int, int], hashes: Sequence[int] = (), session: str | None = None) -> RouteDecision:
        """The replica for a request, given each live replica's load (running + waiting) and the
        prompt's block hashes; the prompt's blocks are then counted as held by that replica."""
        if not loads:
            raise ValueError("no replica is serving")
        decision = self._decide(loads, hashes, session)
        self._last_chosen[decision.replica] = next(self._turn)
        if hashes and self.policy in ("cache_aware", "session"):
            self.index.insert(decision.replica, hashes)
            r = decision.replica
            self._new_blocks[r] = self._new_blocks.get(r, 0) + len(hashes) - decision.matched_blocks
        return decision

    def _decide(self, loads: dict[int, int], hashes: Sequence[int], session: str | None) -> RouteDecision:
        live = sorted(loads)
        base = {"policy": self.policy, "prompt_blocks": len(hashes), "loads": dict(loads)}
        if len(live) == 1:
            return RouteDecision(live[0], reason="only_replica", **base)
        if self.policy == "round_robin":
            return RouteDecision(live[next(self._rr) % len(live)], reason="round_robin", **base)
        if self.policy == "least_load":
            return RouteDecision(self._least_loaded(loads), reason="least_load", **base)
        if self.policy == "session":
            if session:
                return RouteDecision(rendezvous(session, live), reason="session", **base)
            return RouteDecision(self._least_loaded(loads), reason="least_load", **base)
        # cache_aware
        if self._imbalanced(loads):
            return RouteDecision(self._least_loaded(loads), reason="imbalance", **base)
        matches = {r: self.index.match(r, hashes) for r in live} if hashes else {}
        best = max(matches.values(), default=0)
        if best == 0:
            if not hashes:
                return RouteDecision(self._least_loaded(loads), reason="least_load", **base)
            # A new prefix: to the replica sent the fewest new blocks so far (as SGLang's smallest
            # tree), which spreads new prefixes, and so the caches' contents, evenly whatever each
            # replica's speed. (Not the index's size: a busier replica evicts more, looks emptier,
            # and would draw ever more.)
            fewest = min(self._new_blocks.get(r, 0) for r in live)
            return RouteDecision(self._least_loaded(loads, [r for r in live if self._new_blocks.get(r, 0) == fewest]),
                                 reason="least_cached", **base)
        tied = [r for r in live if matches[r] == best]
        return RouteDecision(self._least_loaded(loads, tied), reason="prefix_match", matched_blocks=best, **base)

    def forget_replica(self, replica: int) -> None:
        """It restarted (or was ejected): whatever it held is gone, and it starts level with the
        replica sent the fewest new blocks (not at zero, which would send it every new prefix)."""
        self.index.clear(replica)
        others = [n for r, n in self._new_blocks.items() if r != replica]
        self._new_blocks[replica] = min(others, default=0)


def rendezvous(key: str, replicas: Sequence[int]) -> int:
    """The replica with the highest hash of (key, replica): stable per key, and only the keys of a
    replica that leaves move."""
    def score(r: int) -> bytes:
        return hashlib.blake2b(f"{key}\x00{r}".encode(), digest_size=8).digest()

    return max(replicas, key=score)
