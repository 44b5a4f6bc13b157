"""Optional API keys: Bearer authentication and per-key limits for the ingress.

Pure Python (pydantic only). ``AppConfig.http.api_keys`` lists :class:`ApiKeySpec` entries; an empty list
leaves the API open. The ingress builds a :class:`Keyring` from them once, then for each request

- :meth:`Keyring.authenticate` maps the ``Authorization`` header to an :class:`ApiKey` (or raises a
  401 :class:`~app.api.APIError`),
- :meth:`Keyring.admit` takes one request from the caller's request-rate bucket (or raises a 429 with
  ``Retry-After``),
- :meth:`Keyring.acquire` takes one of the key's concurrent-request slots (or raises a 429 with
  ``Retry-After``); the returned :class:`Lease` is released when the request ends, however it ends,
- :meth:`ApiKey.max_tokens_limit`, :meth:`ApiKey.check_priority` and :meth:`ApiKey.check_prompt` apply
  the key's limits (``priority`` above the key's ``max_priority``: 403),
- :meth:`Keyring.charge` takes the request's prompt tokens + ``max_tokens`` from the caller's
  tokens-per-minute bucket (429 with ``Retry-After`` when they are not there yet).

Rate limits are token buckets (:class:`RateLimiter`) per key; with no keys configured, per client address
(``http.requests_per_second`` and ``http.tokens_per_minute``, off by default). Both are off unless set.

A key is never kept, compared, logged or echoed as text: the keyring holds SHA-256 digests, compares
them with :func:`hmac.compare_digest`, and names a key by its configured ``name``. A config need not hold a
key at all: ``key_hash`` is a salted PBKDF2 hash of it (:func:`hash_key`; ``remask serve --api-key`` writes
one, since Ray Serve logs an application's args at every deploy), checked in constant time against the
presented key (each distinct presented key is hashed once per process: the answer is remembered under its
SHA-256 digest). A rejected key is
logged as an 8-hex-digit HMAC under a per-process random salt (:meth:`Keyring.fingerprint`), which
links repeated attempts within one process but cannot be reversed or checked offline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from app.api import APIError, invalid, permission_error, rate_limit_error

log = logging.getLogger(__name__)


class ApiKeySpec(BaseModel):
    """One API key: where its secret comes from (exactly one of ``key``, ``key_env``, ``key_file``) and its
    limits (``None``: only the application's own limits apply)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="how logs and metrics name the key (never the key itself)")
    key: SecretStr | None = Field(None, description="the key itself (tests; it then sits in the config)")
    key_env: str | None = Field(None, description="environment variable of the ingress replica holding the key")
    key_file: str | None = Field(None, description="file holding the key (surrounding whitespace is stripped)")
    key_hash: str | None = Field(None, description="a salted hash of the key (app.auth.hash_key: "
                                                   "pbkdf2_sha256$ITERATIONS$SALT$HASH, hex): the key itself is in "
                                                   "no config and no log")
    max_concurrent: int | None = Field(None, ge=1, description="requests of this key in flight at once")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens per request")
    max_tokens: int | None = Field(None, ge=1, description="max_tokens per request (also caps the default)")
    max_priority: int = Field(0, ge=0, description="highest `priority` its requests may ask for (above it: 403)")
    requests_per_second: float | None = Field(None, gt=0, description="request rate (a token bucket); unset: "
                                                                       "http.requests_per_second")
    request_burst: int | None = Field(None, ge=1, description="requests at once after an idle spell (the bucket's "
                                                              "size); default max(1, requests_per_second)")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt tokens + max_tokens per minute, counted "
                                                                  "at admission; unset: http.tokens_per_minute")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeySpec:
        given = [s for s in ("key", "key_env", "key_file", "key_hash") if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(f"API key {self.name!r}: give exactly one of key, key_env, key_file, key_hash "
                             f"(got {given})")
        if self.key_hash is not None:
            parse_key_hash(self.key_hash, self.name)
        return self

    def secret(self, environ: Mapping[str, str] | None = None) -> str:
        """The key's text, read now; errors name the source, never the key (a ``key_hash`` entry has none)."""
        if self.key_hash is not None:
            raise ValueError(f"API key {self.name!r} is given as key_hash: its text is nowhere")
        if self.key is not None:
            text, where = self.key.get_secret_value(), "key"
        elif self.key_env is not None:
            env = os.environ if environ is None else environ
            if not env.get(self.key_env):
                raise ValueError(f"API key {self.name!r}: environment variable {self.key_env} is not set")
            text, where = env[self.key_env].strip(), f"environment variable {self.key_env}"
        else:
            try:
                text = Path(self.key_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"API key {self.name!r}: cannot read {self.key_file}: {type(exc).__name__}") from None
            where = self.key_file
        if not text or not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
            raise ValueError(f"API key {self.name!r} (from {where}): a key must be non-empty printable ASCII "
                             "without spaces")
        return text


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "backslashreplace")).digest()


KEY_HASH_SCHEME = "pbkdf2_sha256"
KEY_HASH_ITERATIONS = 50_000  # ~20-50 ms once per distinct presented key and process: slow for a guesser


@dataclass(frozen=True)
class KeyHash:
    """A parsed ``key_hash``: PBKDF2-HMAC-SHA256 of the key under ``salt``, ``iterations`` rounds."""

    iterations: int
    salt: bytes
    hash: bytes

    def of(self, token: str) -> bytes:
        return hashlib.pbkdf2_hmac("sha256", token.encode("utf-8", "backslashreplace"), self.salt, self.iterations)


def hash_key(key: str, *, iterations: int = KEY_HASH_ITERATIONS, salt: bytes | None = None) -> str:
    """A salted hash of ``key`` for ``ApiKeySpec.key_hash`` (a random 16-byte salt unless given)."""
    salt = os.urandom(16) if salt is None else salt
    h = KeyHash(iterations, salt, b"")
    return f"{KEY_HASH_SCHEME}${iterations}${salt.hex()}${h.of(key).hex()}"


def parse_key_hash(text: str, name: str = "?") -> KeyHash:
    """``pbkdf2_sha256$ITERATIONS$SALT$HASH`` (salt and hash in hex); a clear error naming the key otherwise."""
    parts = text.split("$")
    try:
        if len(parts) != 4 or parts[0] != KEY_HASH_SCHEME:
            raise ValueError
        iterations, salt, digest = int(parts[1]), bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
        if iterations < 1000 or len(salt) < 8 or len(digest) != 32:
            raise ValueError
    except ValueError:
        raise ValueError(f"API key {name!r}: key_hash must read {KEY_HASH_SCHEME}$ITERATIONS$SALT$HASH (at least "
                         "1000 iterations, a salt of 8+ bytes and a 32-byte hash, in hex), as app.auth.hash_key "
                         "writes it") from None
    return KeyHash(iterations, salt, digest)


@dataclass(frozen=True)
class RateLimits:
    """A caller's rate limits: requests per second (a bucket of ``request_burst`` requests, default
    ``max(1, requests_per_second)``) and prompt + max_tokens tokens per minute (a bucket of one minute's
    tokens). ``None``: no limit."""

    requests_per_second: float | None = None
    request_burst: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.requests_per_second is not None and not self.requests_per_second > 0:
            raise ValueError(f"requests_per_second must be > 0, got {self.requests_per_second}")
        if self.request_burst is not None and self.request_burst < 1:
            raise ValueError(f"request_burst must be >= 1, got {self.request_burst}")
        if self.tokens_per_minute is not None and self.tokens_per_minute < 1:
            raise ValueError(f"tokens_per_minute must be >= 1, got {self.tokens_per_minute}")

    @property
    def enabled(self) -> bool:
        return self.requests_per_second is not None or self.tokens_per_minute is not None

    @property
    def burst(self) -> int:
        """The request bucket's size."""
        if self.request_burst is not None:
            return self.request_burst
        return max(1, math.ceil(self.requests_per_second or 1))

    def over(self, own: RateLimits) -> RateLimits:
        """``own`` (a key's), each unset limit taken from these defaults; a key's own rate comes with its own
        burst (or the default burst of that rate)."""
        def pick(mine, default):
            return mine if mine is not None else default

        burst = pick(own.request_burst, None if own.requests_per_second is not None else self.request_burst)
        return RateLimits(pick(own.requests_per_second, self.requests_per_second), burst,
                          pick(own.tokens_per_minute, self.tokens_per_minute))


NO_LIMITS = RateLimits()


@dataclass(frozen=True)
class ApiKey:
    """An authenticated caller: the key's name and limits (the digest stays inside the keyring)."""

    name: str
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_priority: int = 0
    limits: RateLimits = NO_LIMITS

    def check_priority(self, priority: int) -> None:
        """Raise a 403 when ``priority`` is above what the key allows (lower priorities are anyone's)."""
        if priority > self.max_priority:
            who = "This API key" if self.name != OPEN_NAME else "A request without an API key"
            asked = str(priority) if priority < 10**12 else "more"
            raise permission_error(f"{who} may not ask for 'priority' above {self.max_priority}; the request "
                                   f"asked for {asked}.", param="priority", code="priority_not_allowed")

    def max_tokens_limit(self, app_limit: int) -> int:
        """The largest max_tokens this caller may ask for."""
        return app_limit if self.max_tokens is None else min(app_limit, self.max_tokens)

    def check_prompt(self, prompt_tokens: int) -> None:
        """Raise a 400 when the prompt is longer than the key allows."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise invalid(f"This API key allows prompts of at most {self.max_prompt_tokens} tokens; your prompt has "
                          f"{prompt_tokens}.", param="prompt", code="prompt_too_long")


OPEN_NAME = "-"
OPEN = ApiKey(OPEN_NAME)  # the caller when no keys are configured (and none of the http section's limits set)


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; starts full."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity, self.level, self.stamp = rate, capacity, capacity, now

    def wait(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (0: they are now)."""
        self.level = min(self.capacity, self.level + max(now - self.stamp, 0.0) * self.rate)
        self.stamp = max(now, self.stamp)
        return 0.0 if self.level >= n else (n - self.level) / self.rate

    def full(self, now: float) -> bool:
        return self.level + max(now - self.stamp, 0.0) * self.rate >= self.capacity


class RateLimiter:
    """Token buckets per caller (a key's name, or a client address): a request bucket and a tokens bucket.
    Callers are kept in least-recently-used order, at most ``max_callers`` (an evicted caller starts with
    full buckets, as an idle one would be)."""

    PRUNE_S = 60.0  # at most this often, callers whose buckets are full again are forgotten

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_callers: int = 65536) -> None:
        self.clock, self.max_callers = clock, max_callers
        self._callers: OrderedDict[str, list[TokenBucket | None]] = OrderedDict()
        self._pruned = clock()

    def __len__(self) -> int:
        return len(self._callers)

    def _buckets(self, who: str, limits: RateLimits, now: float) -> list[TokenBucket | None]:
        entry = self._callers.get(who)
        if entry is None:
            if now - self._pruned >= self.PRUNE_S:
                self.prune()
            entry = [None, None]
            self._callers[who] = entry
            if len(self._callers) > self.max_callers:
                self._callers.popitem(last=False)
        else:
            self._callers.move_to_end(who)
        if limits.requests_per_second is not None and entry[0] is None:
            entry[0] = TokenBucket(limits.requests_per_second, limits.burst, now)
        if limits.tokens_per_minute is not None and entry[1] is None:
            entry[1] = TokenBucket(limits.tokens_per_minute / 60.0, limits.tokens_per_minute, now)
        return entry

    def admit(self, who: str, limits: RateLimits, subject: str) -> None:
        """Take one request from ``who``'s request bucket; 429 + ``Retry-After`` when it is empty."""
        if limits.requests_per_second is None:
            return
        now = self.clock()
        bucket = self._buckets(who, limits, now)[0]
        wait = bucket.wait(1, now)
        if wait > 0:
            raise rate_limit_error(f"Rate limit reached for requests: {subject} may send "
                                   f"{limits.requests_per_second:g} requests per second (bursts of {limits.burst}). "
                                   f"Try again in {wait:.2f} s.", retry_after_s=wait)
        bucket.level -= 1

    def charge(self, who: str, limits: RateLimits, tokens: int, subject: str) -> None:
        """Take ``tokens`` (prompt + max_tokens) from ``who``'s tokens bucket; 429 + ``Retry-After`` when they
        are not there yet, 400 when the bucket can never hold them."""
        tpm = limits.tokens_per_minute
        if tpm is None:
            return
        if tokens > tpm:
            raise invalid(f"This request needs {tokens} tokens (prompt + max_tokens) but {subject} may use {tpm} "
                          "tokens per minute: lower max_tokens or shorten the prompt.", param="max_tokens",
                          code="tokens_per_minute_exceeded")
        now = self.clock()
        bucket = self._buckets(who, limits, now)[1]
        wait = bucket.wait(tokens, now)
        if wait > 0:
            raise rate_limit_error(f"Rate limit reached for tokens per minute: {subject} may use {tpm} (prompt + "
                                   f"max_tokens); this request needs {tokens}, {int(bucket.level)} are left. Try "
                                   f"again in {wait:.2f} s.", retry_after_s=wait)
        bucket.level -= tokens

    def prune(self) -> int:
        """Forget callers whose buckets are full (as a new caller's would be); how many."""
        now = self._pruned = self.clock()
        idle = [who for who, entry in self._callers.items() if all(b is None or b.full(now) for b in entry)]
        for who in idle:
            del self._callers[who]
        return len(idle)


class Lease:
    """One concurrent-request slot of a key; :meth:`release` is idempotent."""

    def __init__(self, counts: dict[str, int] | None, name: str) -> None:
        self._counts, self._name = counts, name
        self.released = counts is None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._counts[self._name] -= 1


@dataclass
class Keyring:
    """The configured keys (as digests) and how many requests each has in flight."""

    keys: list[tuple[bytes, ApiKey]] = field(default_factory=list)
    hashed: list[tuple[KeyHash, ApiKey]] = field(default_factory=list)  # the key_hash entries
    active: dict[str, int] = field(default_factory=dict)
    open: ApiKey = OPEN  # every caller when no keys are configured
    limiter: RateLimiter = field(default_factory=RateLimiter)
    _salt: bytes = field(default_factory=lambda: os.urandom(16), repr=False)
    # presented keys already checked against the hashed entries, by SHA-256 digest: the match (None: none)
    _checked: OrderedDict = field(default_factory=OrderedDict, repr=False)
    checked_limit: int = 4096

    @classmethod
    def from_specs(cls, specs: list[ApiKeySpec], environ: Mapping[str, str] | None = None, *,
                   defaults: RateLimits = NO_LIMITS, max_priority_without_key: int = 0,
                   clock: Callable[[], float] = time.monotonic) -> Keyring:
        """The keyring of ``specs``; ``defaults``: the rate limits of a key that sets none of its own, and of
        each client address when no keys are configured; ``max_priority_without_key``: the highest priority
        a request may ask for when no keys are configured."""
        ring = cls(limiter=RateLimiter(clock))
        if defaults.enabled or max_priority_without_key:
            ring.open = ApiKey(OPEN_NAME, max_priority=max_priority_without_key, limits=defaults)
        names: set[str] = set()
        for spec in specs:
            if spec.name in names:
                raise ValueError(f"API key name {spec.name!r} is used twice")
            names.add(spec.name)
            own = RateLimits(spec.requests_per_second, spec.request_burst, spec.tokens_per_minute)
            if spec.key_hash is not None:
                ring.hashed.append((parse_key_hash(spec.key_hash, spec.name),
                                    ApiKey(spec.name, spec.max_concurrent, spec.max_prompt_tokens, spec.max_tokens,
                                           spec.max_priority, defaults.over(own))))
                ring.active[spec.name] = 0
                continue
            digest = _digest(spec.secret(environ))
            if any(hmac.compare_digest(digest, d) for d, _ in ring.keys):
                raise ValueError(f"API key {spec.name!r} has the same key as another entry")
            ring.keys.append((digest, ApiKey(spec.name, spec.max_concurrent, spec.max_prompt_tokens,
                                             spec.max_tokens, spec.max_priority, defaults.over(own))))
            ring.active[spec.name] = 0
        return ring

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.hashed)

    def _check_hashed(self, token: str, presented: bytes) -> ApiKey | None:
        """The ``key_hash`` entry ``token`` is the key of (every entry compared in constant time), remembered
        under the token's digest so a key is hashed once per process, however many requests carry it."""
        if presented in self._checked:
            self._checked.move_to_end(presented)
            return self._checked[presented]
        match = None
        for h, key in self.hashed:
            if hmac.compare_digest(h.of(token), h.hash):
                match = key
        self._checked[presented] = match
        while len(self._checked) > self.checked_limit:
            self._checked.popitem(last=False)
        return match

    def fingerprint(self, token: str) -> str:
        """A short, non-reversible tag of a presented key (stable within this process only)."""
        return hmac.new(self._salt, token.encode("utf-8", "backslashreplace"), hashlib.sha256).hexdigest()[:8]

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The caller of a request whose ``Authorization`` header is ``authorization``; 401 unless it is
        ``Bearer <a configured key>``. With no keys configured every caller is :attr:`open`."""
        if not self.enabled:
            return self.open
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("You didn't provide an API key. You need to provide your API key in an "
                                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        presented, match = _digest(token), None
        for digest, key in self.keys:  # every entry is compared: the time does not depend on which one matched
            if hmac.compare_digest(digest, presented):
                match = key
        if match is None and self.hashed:
            match = self._check_hashed(token, presented)
        if match is None:
            log.info("rejected an unknown API key (fingerprint %s)", self.fingerprint(token))
            raise _unauthorized("Incorrect API key provided.")
        return match

    def _caller(self, key: ApiKey, client: str | None) -> tuple[str, str]:
        """Whose buckets a request of ``key`` from address ``client`` draws on, and how errors name it."""
        if key.name == OPEN_NAME and not self.enabled:
            return f"address {client or '?'}", f"the client address {client or '(unknown)'}"
        return f"key {key.name}", "this API key"

    def admit(self, key: ApiKey, client: str | None = None) -> None:
        """One request of ``key`` (from ``client``, an address, when no keys are configured) against its
        requests-per-second limit: 429 with ``Retry-After`` past it."""
        if key.limits.requests_per_second is not None:
            who, subject = self._caller(key, client)
            self.limiter.admit(who, key.limits, subject)

    def charge(self, key: ApiKey, tokens: int, client: str | None = None) -> None:
        """A request's ``tokens`` (prompt + max_tokens) against ``key``'s tokens-per-minute limit: 429 with
        ``Retry-After`` past it, 400 when the limit can never allow them."""
        if key.limits.tokens_per_minute is not None:
            who, subject = self._caller(key, client)
            self.limiter.charge(who, key.limits, tokens, subject)

    def acquire(self, key: ApiKey) -> Lease:
        """Take one of ``key``'s concurrent-request slots; 429 with ``Retry-After`` when all are taken."""
        if key.name not in self.active or not self.enabled:
            return Lease(None, key.name)
        if key.max_concurrent is not None and self.active[key.name] >= key.max_concurrent:
            raise rate_limit_error(f"Too many concurrent requests for this API key: at most {key.max_concurrent} "
                                   "may be in flight at once.", retry_after_s=1.0)
        self.active[key.name] += 1
        return Lease(self.active, key.name)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
