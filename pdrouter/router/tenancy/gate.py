"""Tenancy: the API keys file, per-key limits, priorities and the admission queue, as the
router's service uses them.

    identify(authorization)     the client's ApiKey (None: no keys file, or an --api-key key)
    admit(ctx, key, header)     the request's priority: its `priority` field, else its
                                X-Priority header, else its key's default, never more
                                urgent than its key's max_priority (clamped); then its
                                key's limits, charged the request's whole bound (400 past
                                what the bucket can ever hold, 429 naming the limit)
    call(authorization)         a call that generates nothing (the tokenizer routes):
                                its key's call limits, as a completion's
    enter(ctx) / leave(ctx)     the --max-in-flight slot, queued by priority, urgent
                                requests with a reserve beyond it (tenancy.queue); then
                                the decode side's room, waited for with the queue on
    end(ctx, status)            the key's usage settled and counted in the metrics: the
                                answer's usage, else what was relayed (a client gone
                                mid-stream pays for the tokens it was sent)

The keys file is re-read when it changes (polled every --api-keys-reload-s) and on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from pdrouter.common.auth import matching_api_key, require_bearer
from pdrouter.common.flags import flag
from pdrouter.router.observability.timeline import Timeline
from pdrouter.router.selection.admission import Admission
from pdrouter.router.tenancy.key_metrics import KeyMetrics
from pdrouter.router.tenancy.keys_file import ApiKey, KeysFile
from pdrouter.router.tenancy.limits import KeyLimits, Ticket
from pdrouter.router.tenancy.queue import AdmissionQueue
from pdrouter.router.tenancy.usage_meter import UsageMeter
from pdrouter.wire.errors import APIError, clip

log = logging.getLogger(__name__)
PRIORITY_HEADER = "x-priority"
_PRIORITY_RANGE = (-(2**31), 2**31)


@dataclass(frozen=True)
class TenancyConfig:
    api_keys_file: str | None = field(
        default=None,
        metadata=flag(
            "--api-keys-file",
            "JSON file of client API keys, each with an id and optional limits "
            "(requests_per_minute, tokens_per_minute, max_concurrent) and default priority "
            "(docs/operations.md); re-read on change and on SIGHUP. Its keys are accepted "
            "beside --api-key's",
            metavar="PATH",
        ),
    )
    api_keys_reload_s: float = field(
        default=2.0,
        metadata=flag("--api-keys-reload-s", "how often the API keys file is checked for change"),
    )
    max_queued_requests: int = field(
        default=0,
        metadata=flag(
            "--max-queued-requests",
            "requests beyond --max-in-flight that wait for a slot, the most urgent priority "
            "first, instead of a 429 at once; with it, a request the decode side has no room "
            "for waits too, until a request ends (0: no queue)",
        ),
    )
    max_queue_wait_s: float = field(
        default=30.0,
        metadata=flag("--max-queue-wait-s", "longest wait in that queue; then 429"),
    )
    urgent_reserve: int = field(
        default=0,
        metadata=flag(
            "--urgent-reserve",
            "requests beyond --max-in-flight, and decode calls beyond the decode instances' "
            "bounds, that only urgent requests (--urgent-priority) may start: an urgent "
            "request does not wait for a less urgent stream to end (0: none)",
        ),
    )
    urgent_priority: int = field(
        default=-1,
        metadata=flag(
            "--urgent-priority",
            "the least urgent priority that may use --urgent-reserve (vLLM's order: lower is "
            "more urgent; the default priority is 0)",
        ),
    )

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0 or self.max_queue_wait_s <= 0:
            raise ValueError("max_queued_requests must be >= 0 and max_queue_wait_s > 0")
        if self.urgent_reserve < 0:
            raise ValueError(f"urgent_reserve must be >= 0, got {self.urgent_reserve}")
        if self.api_keys_reload_s <= 0:
            raise ValueError(f"api_keys_reload_s must be > 0, got {self.api_keys_reload_s}")


class TenantRequest(Protocol):
    """What tenancy reads and sets of a request (orchestrator.context.TenantRequest)."""

    priority: int | None
    ticket: Ticket | None
    num_prompt_tokens: int
    num_output_tokens: int
    answered_s: float
    meter: UsageMeter
    timeline: Timeline | None

    @property
    def num_tokens_bound(self) -> int: ...


class Tenancy:
    """Per-app: the keys file (when set), the keys' limits and usage, the admission queue."""

    def __init__(self, cfg: TenancyConfig, admission: Admission, metrics: KeyMetrics) -> None:
        self.cfg = cfg
        self.keys = KeysFile(cfg.api_keys_file) if cfg.api_keys_file else None
        self.limits = KeyLimits()
        self.metrics = metrics
        self.queue = AdmissionQueue(
            admission,
            cfg.max_queued_requests,
            cfg.max_queue_wait_s,
            cfg.urgent_reserve,
            cfg.urgent_priority,
        )
        # Set (and replaced) at each request's end: what a request waiting for the decode
        # side's room (enter) waits on.
        self._freed = asyncio.Event()
        self._sighup = False  # a SIGHUP handler installed by start()
        self._watch: asyncio.Task[None] | None = None

    def identify(self, authorization: str | None, api_key: str | None) -> ApiKey | None:
        """The keys file's key the header carries; None for a key of --api-key (no limits);
        401 for neither. Without a keys file: None (the service checks --api-key)."""
        if self.keys is None:
            return None
        key = self.keys.match(authorization)
        if key is None and matching_api_key(authorization, api_key) is None:
            require_bearer(None, "", "API key")  # raises the 401
        return key

    def admit(self, ctx: TenantRequest, key: ApiKey | None, header: str | None) -> None:
        """Set ctx.priority (the field, the header, the key's default; a keys-file key's claim
        clamped to its max_priority) and charge the key the request's whole bound; a refusal
        (400 for a bad header or a request its bucket can never hold, 429 past a limit) ends
        the request's timeline."""
        try:
            if ctx.priority is None:
                ctx.priority = _header_priority(header) if header is not None else None
            if key is None:
                ctx.priority = ctx.priority if ctx.priority is not None else 0
                return
            # Lower is more urgent: a claim more urgent than the key's cap is served at the
            # cap, not refused (a client library that always sends X-Priority keeps working).
            wanted = key.priority if ctx.priority is None else ctx.priority
            ctx.priority = max(wanted, key.max_priority)
            try:
                ctx.ticket = self.limits.admit(key, ctx.num_tokens_bound, time.monotonic())
            except APIError as exc:
                if exc.status == 429:
                    self.metrics.rejected.labels(key.key_id, exc.stage).inc()
                self.metrics.requests.labels(key.key_id, str(exc.status)).inc()
                raise
        except APIError as exc:
            if ctx.timeline is not None:
                ctx.timeline.end(exc.status, stage=exc.stage, error=exc.message)
            raise
        finally:
            if ctx.timeline is not None:
                ctx.timeline.priority = ctx.priority
        self._count_in_flight(key.key_id)

    @contextlib.contextmanager
    def call(self, authorization: str | None, api_key: str | None) -> Iterator[None]:
        """A call of a keys-file key that generates nothing (the tokenizer routes), for the
        with-block's length: counted against its key's requests_per_minute and
        max_concurrent as a completion is (429 naming the limit past one), and by status in
        its metrics. Another key, or no keys file: nothing counted."""
        key = self.identify(authorization, api_key)
        if key is None:
            yield
            return
        try:
            ticket = self.limits.admit(key, 0, time.monotonic())
        except APIError as exc:
            self.metrics.rejected.labels(key.key_id, exc.stage).inc()
            self.metrics.requests.labels(key.key_id, str(exc.status)).inc()
            raise
        self._count_in_flight(key.key_id)  # it holds a max_concurrent slot, as admit's do
        status = 500
        try:
            yield
            status = 200
        except APIError as exc:
            status = exc.status
            raise
        finally:
            self.limits.settle(ticket, 0, time.monotonic())
            self._count_in_flight(key.key_id)
            self.metrics.requests.labels(key.key_id, str(status)).inc()

    def _count_in_flight(self, key_id: str) -> None:
        self.metrics.in_flight[key_id] = self.limits.id_to_state[key_id].in_flight

    async def enter(self, ctx: TenantRequest, check_room: Callable[[int], None]) -> None:
        """Hold a --max-in-flight slot (queued by priority), then check_room(priority) (the
        instances' room, which raises its 429; an urgent priority may add calls past their
        bounds, its --urgent-reserve: Selector.reserve_of): a request waits for its turn
        before it is weighed. With the queue on (--max-queued-requests), a request the
        decode side has no room for now waits for a request to end, within the same
        --max-queue-wait-s, before its 429; a 400 (it can never fit) never waits."""
        priority = ctx.priority or 0
        deadline_s = asyncio.get_running_loop().time() + self.cfg.max_queue_wait_s
        await self.queue.enter(priority)
        try:
            while True:
                freed = self._freed  # taken before the check: an end after it wakes us
                try:
                    check_room(priority)
                    return
                except APIError as exc:
                    left_s = deadline_s - asyncio.get_running_loop().time()
                    if exc.status != 429 or not self.cfg.max_queued_requests or left_s <= 0:
                        raise
                    # at the deadline, weighed once more: its 429 says what is held then
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(freed.wait()), left_s)
        except BaseException:
            self.queue.leave()
            raise

    def leave(self) -> None:
        """A request ends (after its decode reservation went back): its slot to the queue,
        and every request waiting for the decode side's room weighed again."""
        self.queue.leave()
        self._freed.set()
        self._freed = asyncio.Event()

    def end(self, ctx: TenantRequest | None, status: int) -> None:
        """The request's key usage: what it used (its answer's usage; a request that ended
        early, its client gone mid-stream included, what was relayed of it: its meter),
        settled against its limits and counted by id."""
        ticket = ctx.ticket if ctx is not None else None
        if ticket is None:
            return
        assert ctx is not None
        n_prompt, n_out = ctx.num_prompt_tokens, ctx.num_output_tokens
        if not ctx.answered_s:  # no complete answer: what it got before it ended
            n_prompt, n_out = ctx.meter.num_prompt_tokens, ctx.meter.num_output_tokens
        self.limits.settle(ticket, n_prompt + n_out, time.monotonic())
        key_id = ticket.key.key_id
        self._count_in_flight(key_id)
        self.metrics.requests.labels(key_id, str(status)).inc()
        if n_prompt or n_out:
            self.metrics.tokens.labels(key_id, "prompt").inc(n_prompt)
            self.metrics.tokens.labels(key_id, "generation").inc(n_out)

    def start(self) -> None:
        """Watch the keys file: polled for change, and re-read on SIGHUP."""
        if self.keys is None:
            return
        keys = self.keys
        # Signal handlers belong to the main thread's loop; elsewhere (a test's server thread)
        # the poll alone reloads.
        self._sighup = threading.current_thread() is threading.main_thread()
        if self._sighup:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
        self._watch = asyncio.ensure_future(self._poll(keys))

    async def _poll(self, keys: KeysFile) -> None:
        while True:
            await asyncio.sleep(self.cfg.api_keys_reload_s)
            if keys.changed():
                keys.reload()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            if self._sighup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)


def _header_priority(value: str) -> int:
    """The X-Priority header as an integer, or a 400 naming it."""
    try:
        priority = int(value.strip())
    except ValueError:
        priority = None
    if priority is None or not _PRIORITY_RANGE[0] <= priority < _PRIORITY_RANGE[1]:
        raise APIError(
            400,
            f"the {PRIORITY_HEADER} header must be an integer (32 bits), got {clip(value)!r}",
            "invalid_request_error",
            param=PRIORITY_HEADER,
        )
    return priority
