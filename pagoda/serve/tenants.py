"""Tenants: API keys, each with optional token-bucket rate limits and a default scheduling priority.

Keys come from `--api-key` (repeatable; no limits) and `--api-keys-file`, either JSON or lines:

    JSON:  [{"key": "sk-a", "name": "team-a", "requests_per_second": 2,
             "tokens_per_minute": 20000, "priority": 0}, ...]
           or {"sk-a": {"requests_per_second": 2, ...}, "sk-b": {}}
    lines: KEY [REQUESTS_PER_SECOND [TOKENS_PER_MINUTE [PRIORITY]]]   ('-' leaves one unset,
           '#' starts a comment; `name=...`, `rps=...`, `tpm=...`, `priority=...` also work)

Limits: a requests-per-second bucket holds up to max(1, rps) requests (a burst of one second's
worth) and refills at rps; a tokens-per-minute bucket holds tokens_per_minute and refills at
tokens_per_minute / 60 per second. A request needs one request token and (to start) its prompt
tokens' worth in the token bucket; its prompt and generated tokens are then charged, so the bucket may
go below zero and later requests wait until it refills.

Priority (lower is more urgent, as in vLLM): the tenant's priority is the default of its requests and
the most urgent value they may ask for.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class TokenBucket:
    """Classic token bucket. `clock` is injectable for tests."""

    def __init__(self, rate_per_s: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        self.rate = float(rate_per_s)
        self.capacity = float(capacity)
        self.clock = clock
        self._level = float(capacity)
        self._t = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.capacity, self._level + (now - self._t) * self.rate)
        self._t = now

    @property
    def level(self) -> float:
        with self._lock:
            self._refill()
            return self._level

    def try_take(self, amount: float = 1.0, need: float | None = None) -> float:
        """Take `amount` if the bucket holds `need` (default: amount; capped at the capacity so a
        big request can still pass on a full bucket). Returns 0.0 when taken, else the seconds
        until it would be."""
        need = min(amount if need is None else need, self.capacity)
        with self._lock:
            self._refill()
            if self._level >= need:
                self._level -= amount
                return 0.0
            return (need - self._level) / self.rate

    def charge(self, amount: float) -> None:
        """Take `amount` unconditionally (the level may go negative)."""
        with self._lock:
            self._refill()
            self._level -= amount

    def refund(self, amount: float) -> None:
        """Give back what was taken for work that never ran (never above the capacity)."""
        with self._lock:
            self._refill()
            self._level = min(self.capacity, self._level + amount)


@dataclass
class Tenant:
    name: str
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    priority: int | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _requests: TokenBucket | None = field(default=None, init=False, repr=False)
    _tokens: TokenBucket | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.requests_per_second is not None:
            if self.requests_per_second <= 0:
                raise ValueError(f"tenant {self.name}: requests_per_second must be > 0")
            rps = self.requests_per_second
            self._requests = TokenBucket(rps, max(1.0, rps), self.clock)
        if self.tokens_per_minute is not None:
            if self.tokens_per_minute <= 0:
                raise ValueError(f"tenant {self.name}: tokens_per_minute must be > 0")
            tpm = self.tokens_per_minute
            self._tokens = TokenBucket(tpm / 60.0, tpm, self.clock)

    def take_request(self) -> float:
        """0.0 when the request may go on, else seconds to wait."""
        return self._requests.try_take(1.0) if self._requests is not None else 0.0

    def take_prompt_tokens(self, num_tokens: int) -> float:
        """Charge a request's prompt tokens; 0.0 when allowed, else seconds to wait."""
        if self._tokens is None:
            return 0.0
        return self._tokens.try_take(float(num_tokens))

    def charge_tokens(self, num_tokens: int) -> None:
        if self._tokens is not None and num_tokens > 0:
            self._tokens.charge(float(num_tokens))

    def refund_prompt_tokens(self, num_tokens: int) -> None:
        """The request was charged but never reached the engine."""
        if self._tokens is not None and num_tokens > 0:
            self._tokens.refund(float(num_tokens))

    def effective_priority(self, requested: int | None) -> int:
        if self.priority is None:
            return requested if requested is not None else 0
        if requested is None:
            return self.priority
        return max(requested, self.priority)


ANONYMOUS = Tenant("anonymous")


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantRegistry:
    """API key -> Tenant. Keys are kept only as SHA-256 digests, looked up by the digest of what a
    client sends, so lookups do not compare secrets byte by byte."""

    def __init__(self) -> None:
        self._by_digest: dict[str, Tenant] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(self, key: str, tenant: Tenant) -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self._by_digest[_key_id(key)] = tenant

    def lookup(self, key: str | None) -> Tenant | None:
        if not key:
            return None
        return self._by_digest.get(_key_id(key))


def _num(value: Any, what: str, line: str) -> float | None:
    if value is None or value == "-":
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"api keys file: {what} must be a number in {line!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"api keys file: {what} must be > 0 in {line!r}")
    return x


def _tenant_from_mapping(key: str, spec: dict, index: int) -> Tenant:
    where = f"entry {index}"
    known = {"key", "api_key", "name", "requests_per_second", "rps", "tokens_per_minute", "tpm", "priority"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"api keys file: unknown field(s) {sorted(unknown)} in {where}")
    prio = spec.get("priority")
    if prio is not None and (not isinstance(prio, int) or isinstance(prio, bool)):
        raise ValueError(f"api keys file: priority must be an integer in {where}")
    return Tenant(
        name=str(spec.get("name") or f"key-{index}"),
        requests_per_second=_num(spec.get("requests_per_second", spec.get("rps")), "requests_per_second", where),
        tokens_per_minute=_num(spec.get("tokens_per_minute", spec.get("tpm")), "tokens_per_minute", where),
        priority=prio,
    )


def parse_api_keys(text: str) -> list[tuple[str, Tenant]]:
    """Parse an api keys file (JSON or lines; see the module docstring)."""
    stripped = text.lstrip()
    out: list[tuple[str, Tenant]] = []
    if stripped.startswith(("[", "{")):
        data = json.loads(text)
        items: list[tuple[str, dict]]
        if isinstance(data, dict):
            items = [(k, v or {}) for k, v in data.items()]
        else:
            items = []
            for i, entry in enumerate(data):
                if isinstance(entry, str):
                    items.append((entry, {}))
                elif isinstance(entry, dict):
                    key = entry.get("key", entry.get("api_key"))
                    if not isinstance(key, str):
                        raise ValueError(f"api keys file: entry {i} has no 'key'")
                    items.append((key, entry))
                else:
                    raise ValueError(f"api keys file: entry {i} must be an object or a string")
        for i, (key, spec) in enumerate(items):
            if not isinstance(spec, dict):
                raise ValueError(f"api keys file: the value of entry {i} must be an object")
            out.append((key, _tenant_from_mapping(key, spec, i)))
        return out
    aliases = {"rps": "requests_per_second", "tpm": "tokens_per_minute"}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        key, rest = words[0], words[1:]
        spec: dict[str, Any] = {}
        positional = ["requests_per_second", "tokens_per_minute", "priority"]
        pos = 0
        for w in rest:
            if "=" in w:
                name, value = w.split("=", 1)
                name = aliases.get(name, name)
            else:
                if pos >= len(positional):
                    raise ValueError(f"api keys file line {lineno}: too many fields")
                name, value = positional[pos], w
                pos += 1
            if value == "-":
                continue
            if name == "priority":
                try:
                    spec[name] = int(value)
                except ValueError:
                    raise ValueError(f"api keys file line {lineno}: priority must be an integer") from None
            elif name in ("requests_per_second", "tokens_per_minute"):
                spec[name] = _num(value, name, f"line {lineno}")
            elif name == "name":
                spec[name] = value
            else:
                raise ValueError(f"api keys file line {lineno}: unknown field {name!r}")
        spec.setdefault("name", f"key-{len(out)}")
        out.append((key, _tenant_from_mapping(key, spec, len(out))))
    return out


def build_registry(api_keys: list[str] | None, api_keys_file: str | None) -> TenantRegistry:
    registry = TenantRegistry()
    for i, key in enumerate(api_keys or []):
        registry.add(key, Tenant(f"api-key-{i}"))
    if api_keys_file:
        for key, tenant in parse_api_keys(Path(api_keys_file).read_text()):
            registry.add(key, tenant)
    return registry
