"""Provider quotas shared by every worker, divided between tenants by weight (DESIGN.md section 8.1).

A provider limits an account, not a worker: requests and tokens per minute for one key and model,
however many processes and tenants send with that key. So the limiter's state is in Redis, keyed
by the account (`account_of`: the endpoint's kind, base URL, model and a digest of its API key),
and one Lua script answers a call in one round trip, reading the time from Redis so that every
worker counts on the same clock:

    admit(endpoint, tenant, weight, tokens, caller)
                                              go now, or wait this long (the call is not counted)
    slow_down(endpoint, seconds)              the provider answered Retry-After, or a call timed
                                              out (backoff): every caller of that account waits it
                                              out, not only the one told
    release(endpoint, caller)                 the caller's call is over: its in-flight slot frees

The script keeps, per account:
    tat, ttat   the next time a request may start, for requests and for tokens (GCRA, the
                generic cell rate algorithm). Requests keep a schedule of slots r =
                window / (requests_per_minute - 1) apart and each takes the next slot, or the
                one scheduled if it passed less than r / 4 ago: a call that comes back a little
                late (a countdown is never exact) does not waste its slot, and still any n + 1
                calls span at least n * r - r / 4 = window + 3r / 4, so no window ever holds
                more than the limit, with 3r / 4 to spare for the calls' way to the provider. Providers
                enforce per-minute limits over shorter periods too, so spacing is what they expect. A
                request of k tokens holds the token quota for window * k / tokens_per_minute
    pause       until when the provider asked everyone to wait (Retry-After)
    v, f:<t>    fair order (start-time fair queueing): each admitted call of tenant t takes the
                start tag max(f:<t>, v) and moves f:<t> on by the call's cost / the tenant's
                weight; v is the start tag of the last call admitted. A free slot goes to the
                call that arrives, unless another tenant with a smaller start tag has a call due
                back within one slot plus half a second of now (h:<t>, below; a countdown fires
                late on a busy worker): then it is held for that call. So while several tenants wait, each gets calls in proportion to its weight,
                counted in calls actually made (a slot lost to a late countdown costs everyone
                alike); a tenant alone takes every slot (work-conserving); a tenant that was idle
                starts at v, with no credit saved up
    waiting:<t> the tenant's waiting calls (run id -> when it comes back): a new one is told to
                come back one fair spacing (the slot times the weights of the tenants waiting
                over its own weight) after the tenant's last, a run coming back and held again
                keeps its place, so a tenant's 500 runs come back spread out, not all at once;
                h:<t> is the earliest, w:<t> the tenant's weight
    active      the tenants with calls waiting or served within their fair spacing, scored by
                when that ends: the weights the fair spacing divides by
    inflight    the calls out now (run id -> when its slot lapses: the endpoint's timeout and a
                margin, so a worker that died frees its slot by itself), for the endpoint's
                max_in_flight: while as many are out, a call waits like any other (limit
                "in_flight"), coming back when the oldest slot lapses or IN_FLIGHT_POLL_SECONDS
                passed, whichever is sooner; a run holds at most one slot (it makes one call
                at a time), and asking again replaces it

A call that must wait is not counted and holds nothing: the engine sends the run's next message
with the countdown (runs/engine/model_step.quota_wait) and the run asks again then. With Redis
unreachable or slow the call goes ahead unlimited (counted in agentplatform_quota_unavailable):
the provider's own 429s are still retried, and a limiter outage must not stop every run.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass

import redis
from django.conf import settings

from llm.models import ModelEndpoint
from observability import metrics

log = logging.getLogger(__name__)

# A provider's Retry-After longer than this is taken as this: a bad header must not park a fleet.
MAX_PAUSE_SECONDS = 600.0
# How soon a call held by max_in_flight asks again (a slot frees when a call ends; the waiting
# runs learn of it when they ask): one claim and one Redis round trip per waiting run per period.
IN_FLIGHT_POLL_SECONDS = 1.0
# A slot lapses this long after the call's timeout: its worker is gone, or it is still recording.
IN_FLIGHT_MARGIN_SECONDS = 5.0

ADMIT = """
local bucket, active, waiting, inflight = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local tenant, run = ARGV[1], ARGV[7]
local cap, lease = tonumber(ARGV[8]), tonumber(ARGV[9])
local weight = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local rpm = tonumber(ARGV[5])
local tpm = tonumber(ARGV[6])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local req, tok, catch_up = 0, 0, 0
if rpm > 1 then req = window / (rpm - 1); catch_up = req / 4 elseif rpm == 1 then req = window end
if tpm > 0 then tok = window * tokens / tpm end
local cost = math.max(req, tok)
local late = cost + LATE_SECONDS
local s = redis.call('HMGET', bucket, 'tat', 'ttat', 'pause', 'v', 'f:' .. tenant)
local tat, ttat, pause = tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or 0
local v, finish = tonumber(s[4]) or 0, tonumber(s[5]) or 0
local start = math.max(finish, v)
redis.call('ZREMRANGEBYSCORE', active, '-inf', now - cost)
redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now - window - late)
local names = redis.call('ZRANGE', active, 0, -1)
local fields = {}
for _, name in ipairs(names) do
  if name ~= tenant then
    fields[#fields + 1] = 'w:' .. name
    fields[#fields + 1] = 'f:' .. name
    fields[#fields + 1] = 'h:' .. name
  end
end
local total, owed = weight, false
if #fields > 0 then
  local values = redis.call('HMGET', bucket, unpack(fields))
  for i = 1, #values, 3 do
    total = total + (tonumber(values[i]) or 1)
    local their_start, head = math.max(tonumber(values[i + 1]) or 0, v), tonumber(values[i + 2]) or 0
    -- Another tenant further behind its share has a call due back about now: the slot is its.
    if head > 0 and math.abs(head - now) <= late and their_start < start then owed = true end
  end
end
local spacing = cost * total / weight
local full = 0
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now)
  redis.call('ZREM', inflight, run)
  if redis.call('ZCARD', inflight) >= cap then
    full = now + IN_FLIGHT_POLL
    local oldest = tonumber(redis.call('ZRANGE', inflight, 0, 0, 'WITHSCORES')[2])
    if oldest and oldest < full then full = oldest end
  end
end
local ready = math.max(now, tat, ttat, pause, full)
local ttl = math.ceil((math.max(pause - now, 0) + 2 * window + spacing) * 1000)
local function keep(interest)
  local head = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')[2]
  if head then redis.call('HSET', bucket, 'h:' .. tenant, head) else redis.call('HDEL', bucket, 'h:' .. tenant) end
  local last = tonumber(redis.call('ZRANGE', waiting, -1, -1, 'WITHSCORES')[2]) or 0
  redis.call('ZADD', active, math.max(interest, last), tenant)
  redis.call('PEXPIRE', bucket, ttl)
  redis.call('PEXPIRE', active, ttl)
  redis.call('PEXPIRE', waiting, ttl)
end
if ready <= now and not owed then
  -- The slot this call takes: the scheduled one, if it passed less than catch_up ago; else now
  -- (an idle quota saves up no credit).
  if req > 0 then
    if tat < now - catch_up then tat = now end
    tat = tat + req
  end
  if tok > 0 then ttat = now + tok end
  redis.call('HSET', bucket, 'tat', tat, 'ttat', ttat, 'v', start, 'f:' .. tenant, start + cost / weight,
    'w:' .. tenant, weight)
  redis.call('ZREM', waiting, run)
  if cap > 0 then
    redis.call('ZADD', inflight, now + lease, run)
    redis.call('PEXPIRE', inflight, math.ceil(lease * 1000))
  end
  keep(now + spacing)
  return {1, 0, ''}
end
if owed then ready = math.max(ready, now + cost) end
local ticket = ready
if redis.call('ZSCORE', waiting, run) then
  -- Back at its time and still held: it keeps its place among the tenant's waiting calls.
  ticket = ready + redis.call('ZRANK', waiting, run) * spacing
else
  local last = tonumber(redis.call('ZRANGE', waiting, -1, -1, 'WITHSCORES')[2])
  if last then ticket = math.max(ready, last + spacing) end
end
redis.call('ZADD', waiting, ticket, run)
redis.call('HSET', bucket, 'w:' .. tenant, weight)
keep(ticket)
local limit = 'tokens'
if pause > now then limit = 'retry_after'
elseif full > now then limit = 'in_flight'
elseif owed then limit = 'fair_share'
elseif tat >= ttat then limit = 'requests' end
return {0, math.ceil((ticket - now) * 1000000), limit}
""".replace("LATE_SECONDS", "0.5").replace("IN_FLIGHT_POLL", repr(IN_FLIGHT_POLL_SECONDS))

RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

SLOW_DOWN = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local until_ = now + tonumber(ARGV[1])
local pause = tonumber(redis.call('HGET', KEYS[1], 'pause')) or 0
if until_ > pause then
  redis.call('HSET', KEYS[1], 'pause', until_)
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(ARGV[1]) + 2 * tonumber(ARGV[2])) * 1000))
end
return 1
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """The limiter's answer: go now (`wait_seconds` 0) or come back in `wait_seconds`.

    limit: what holds the call back: "requests", "tokens", "fair_share" (other tenants' turn),
    "retry_after" (the provider asked to wait); "" when admitted, "unavailable" when the limiter
    could not be asked and the call goes ahead unlimited.
    """

    wait_seconds: float
    limit: str = ""


GO = Admission(0.0)


class _Limiter:
    """One Redis client and the registered scripts, per process (a client is thread-safe)."""

    def __init__(self, url: str) -> None:
        timeout = settings.QUOTA_TIMEOUT_SECONDS
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0
        )
        # EVALSHA: one round trip; the script is sent once per Redis restart (NOSCRIPT, then EVAL).
        self.admit = self.client.register_script(ADMIT)
        self.slow_down = self.client.register_script(SLOW_DOWN)
        self.release = self.client.register_script(RELEASE)


_limiter: _Limiter | None = None
_limiter_url = ""
_lock = threading.Lock()
_accounts: dict[tuple, str] = {}


def _get_limiter() -> _Limiter | None:
    global _limiter, _limiter_url
    url = settings.QUOTA_REDIS_URL
    if not url:
        return None
    if _limiter is None or _limiter_url != url:
        with _lock:
            if _limiter is None or _limiter_url != url:
                _limiter, _limiter_url = _Limiter(url), url
    return _limiter


def account_of(endpoint: ModelEndpoint) -> str:
    """The provider account an endpoint spends: endpoints of different tenants with the same
    kind, base URL, model and API key share one quota; a scripted endpoint is its own."""
    if endpoint.kind == ModelEndpoint.Kind.SCRIPTED:
        return f"scripted-{endpoint.pk}"
    secret = endpoint.secret if endpoint.secret_id else None
    cache_key = (
        endpoint.kind,
        endpoint.base_url,
        endpoint.model,
        endpoint.secret_id,
        secret and secret.ciphertext,
    )
    account = _accounts.get(cache_key)
    if account is None:
        api_key = secret.reveal() if secret is not None else ""
        material = "\n".join([endpoint.kind, endpoint.base_url.rstrip("/"), endpoint.model, api_key])
        account = hashlib.sha256(material.encode()).hexdigest()[:24]
        if len(_accounts) > 10_000:  # rotated keys: the cache must not grow without bound
            _accounts.clear()
        _accounts[cache_key] = account
    return account


def _keys(account: str, tenant: str = "") -> list[str]:
    # One hash tag: on a Redis Cluster the keys live in one slot, as a script needs.
    return [
        f"quota:{{{account}}}",
        f"quota:{{{account}}}:active",
        f"quota:{{{account}}}:waiting:{tenant}",
        f"quota:{{{account}}}:inflight",
    ]


def admit(endpoint: ModelEndpoint, *, tenant: str, weight: int, tokens: int, caller: str) -> Admission:
    """Ask the account's quota for one call of `tokens` (input estimate plus output cap, as
    providers count them) from `caller` (the run: a run told to wait keeps its place when it
    comes back). Admitted calls are counted, and hold one of the endpoint's max_in_flight slots
    until `release`; a call told to wait is not counted and holds nothing."""
    limiter = _get_limiter()
    if limiter is None:
        return GO
    account = account_of(endpoint)
    try:
        admitted, wait_us, limit = limiter.admit(
            keys=_keys(account, tenant),
            args=[
                tenant,
                max(int(weight), 1),
                max(int(tokens), 0),
                settings.QUOTA_WINDOW_SECONDS,
                endpoint.requests_per_minute or 0,
                endpoint.tokens_per_minute or 0,
                caller,
                endpoint.max_in_flight or 0,
                endpoint.timeout_seconds + IN_FLIGHT_MARGIN_SECONDS,
            ],
        )
    except redis.RedisError as exc:
        metrics.QUOTA_UNAVAILABLE.inc()
        log.warning("quota limiter unreachable, the call goes ahead unlimited: %s", exc)
        return Admission(0.0, "unavailable")
    if admitted:
        metrics.QUOTA_ADMITTED.labels(endpoint=endpoint.name, tenant=tenant).inc()
        return GO
    limit = limit.decode() if isinstance(limit, bytes) else str(limit)
    wait = int(wait_us) / 1_000_000
    metrics.QUOTA_WAITS.labels(endpoint=endpoint.name, tenant=tenant, limit=limit).inc()
    metrics.QUOTA_WAIT_SECONDS.labels(limit=limit).observe(wait)
    return Admission(wait, limit)


def slow_down(endpoint: ModelEndpoint, seconds: float) -> None:
    """The provider answered with Retry-After: no call to this account starts before it passes."""
    limiter = _get_limiter()
    if limiter is None or not seconds > 0:
        return
    seconds = min(float(seconds), MAX_PAUSE_SECONDS)
    metrics.QUOTA_THROTTLES.labels(endpoint=endpoint.name).inc()
    try:
        limiter.slow_down(keys=_keys(account_of(endpoint))[:1], args=[seconds, settings.QUOTA_WINDOW_SECONDS])
    except redis.RedisError as exc:
        metrics.QUOTA_UNAVAILABLE.inc()
        log.warning("quota limiter unreachable, Retry-After %.1fs slows only this run: %s", seconds, exc)


def release(endpoint: ModelEndpoint, caller: str) -> None:
    """The caller's call to the endpoint is over (answered or failed): its in-flight slot frees."""
    limiter = _get_limiter()
    if limiter is None or not endpoint.max_in_flight:
        return
    try:
        limiter.release(keys=_keys(account_of(endpoint))[3:], args=[caller])
    except redis.RedisError as exc:
        metrics.QUOTA_UNAVAILABLE.inc()
        log.warning("quota limiter unreachable, an in-flight slot lapses by itself: %s", exc)
