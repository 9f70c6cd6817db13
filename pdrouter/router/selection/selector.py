"""Which instance a call goes to, and what its outcome does to that instance's breaker.

    candidates = routable (not draining), not tried yet by this request, same fingerprint
    tiers      = healthy  >  never checked (not known down)  >  down (it may be back)
    then       = breaker open? skip  ->  per-instance limit full? 429  ->  policy picks

Decode's limit is enforced once, at the door (ensure_room, before P works), counting the
requests in prefill as decode calls to come and every admitted request's whole token bound
(reserve .. release, for the request's life); the decode pick itself never refuses for load:
by then P's first token may be on its way to the client, and a stream that started is never
sacrificed to load (a D beyond its bound by a few calls queues them in its engine).

The orchestrator asks pick() before each attempt and reports the attempt's outcome with
verdict(); everything here is plain state, tested without sockets.
"""

from __future__ import annotations

from collections.abc import Callable

from pdrouter.router.instances.instance import Instance, Role
from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.admission import Admission
from pdrouter.router.selection.breaker import BreakerBoard
from pdrouter.router.selection.policies import SelectionPolicy, choose


class Selector:
    """Selection over a registry with per-role policies, breakers and admission limits."""

    def __init__(
        self,
        registry: Registry,
        policies: dict[str, SelectionPolicy],
        breakers: BreakerBoard,
        admission: Admission,
        reserve_of: Callable[[int], int] = lambda priority: 0,
    ) -> None:
        self.registry = registry
        self.policies = policies
        self.breakers = breakers
        self.admission = admission
        # priority -> calls past an instance's bound a request may add (its urgent reserve:
        # AdmissionQueue.extra_slots): the one way the reserve reaches selection, given by
        # the decode door (ensure_room) and the prefill pick alike.
        self.reserve_of = reserve_of
        # role -> tokens reserved by the requests admitted and not yet ended: each reserves
        # its whole bound at the door (ensure_room, reserve) for as long as it lasts.
        self.reserved_tokens: dict[Role, int] = {"prefill": 0, "decode": 0}

    def pick(
        self,
        role: Role,
        exclude: set[str],
        body: bytes | None = None,
        cache_scope: str | None = None,
        priority: int = 0,
    ) -> Instance | None:
        """An instance not in exclude, never one of another fingerprint, by preference:
        healthy; then never checked (not known to be down); then down (it may be back, and
        a refused loopback connection costs microseconds). body and cache_scope (the
        request's) are for a policy that reads the prompt (cache_aware). Breakers and
        per-instance limits apply (policies.choose: 429 when all are full, 503 when all
        breakers are open, BreakerBusy when a trial slot should free soon); an urgent
        priority's reserve (reserve_of) raises prefill's limit, as ensure_room does decode's."""
        cluster_fp = self.registry.fingerprint
        healthy: list[Instance] = []
        unchecked: list[Instance] = []  # never checked: not known to be down
        usable: list[Instance] = []
        for inst in self.registry.of_role(role):
            if inst.draining or inst.url in exclude:  # draining instances take nothing new
                continue
            if cluster_fp is not None and inst.fingerprint not in (None, cluster_fp):
                continue
            usable.append(inst)
            if inst.healthy:
                healthy.append(inst)
            elif inst.down_since_s is None:
                unchecked.append(inst)
        policy = self.policies[role]
        tiers = (healthy, unchecked, usable)
        bounded = role == "prefill"  # decode's bound is the door's (ensure_room)
        first = not exclude
        extra_calls = self.reserve_of(priority) if bounded else 0
        return choose(
            role,
            tiers,
            policy,
            self.breakers,
            self.admission,
            first,
            body,
            cache_scope,
            bounded,
            extra_calls,
        )

    def ensure_room(self, role: Role, priority: int = 0, num_tokens: int = 0) -> None:
        """429 before any work when the healthy instances of role have no room left for this
        request: their calls in flight plus one against the sum of their call bounds (for
        decode the requests in prefill counted too: each will be a decode call), and the
        tokens the requests in flight reserved plus this one's (num_tokens: its whole bound,
        RequestContext.num_tokens_bound) against the sum of their token bounds. A request
        larger than that sum, or than --max-request-tokens, can never fit: 400, whatever is
        in flight. The router checks decode before prefill, so P's work is not spent on a
        full D side, and a stream that started never finds D full. An urgent priority's
        reserve (reserve_of) raises the call bound (Admission.bound_of) and lifts the tokens'
        (the engines preempt less urgent work), as pick does prefill's."""
        self.admission.check_request_tokens(num_tokens)
        healthy = self.registry.healthy(role)
        if not healthy:
            return
        extra_calls = self.reserve_of(priority)
        coming = self.registry.prefill if role == "decode" else []
        bounds = [self.admission.bound_of(inst, extra_calls) for inst in healthy]
        if all(bound is not None for bound in bounds):
            held = sum(inst.in_flight for inst in healthy)
            held_coming = sum(inst.in_flight for inst in coming)
            total = sum(bound for bound in bounds if bound is not None)
            if held + held_coming + 1 > total:
                raise self.admission.side_full(role, healthy, held, held_coming, total)
        token_bounds = [self.admission.token_bound(inst) for inst in healthy]
        if any(bound is None for bound in token_bounds):
            return  # an unbounded instance always has room
        total_tokens = sum(bound for bound in token_bounds if bound is not None)
        if num_tokens > total_tokens:
            raise self.admission.never_fits(role, num_tokens, total_tokens, len(healthy))
        if not extra_calls and self.reserved_tokens[role] + num_tokens > total_tokens:
            raise self.admission.tokens_full(
                role, self.reserved_tokens[role], num_tokens, total_tokens
            )

    def admit(
        self, priority: int, num_tokens: int, num_prefill_calls: int, num_prompt_tokens: int
    ) -> None:
        """One request's door: the decode side's room for its whole bound (ensure_room), a
        batch's prefill calls and prompts at once (ensure_fits), then its num_tokens reserved
        on the decode side until release()."""
        self.ensure_room("decode", priority, num_tokens)
        if num_prefill_calls > 1:
            self.ensure_fits("prefill", num_prefill_calls, num_prompt_tokens, priority)
        self.reserve("decode", num_tokens)

    def reserve(self, role: Role, num_tokens: int) -> None:
        """Hold num_tokens (a request's whole bound, after ensure_room) until release()."""
        self.reserved_tokens[role] += num_tokens

    def release(self, role: Role, num_tokens: int) -> None:
        assert self.reserved_tokens[role] >= num_tokens, "release without a matching reserve"
        self.reserved_tokens[role] -= num_tokens

    def ensure_fits(
        self, role: Role, num_calls: int, num_tokens: int = 0, priority: int = 0
    ) -> None:
        """400 when a batch needs more calls to role at once (num_calls: its sub-requests,
        orchestrator.choices), or more tokens (num_tokens: its prompts' estimate), than the
        healthy instances of role can ever take: its calls would find them full on an idle
        cluster. An urgent priority's reserve raises the calls and lifts the tokens, as at
        the prefill pick."""
        healthy = self.registry.healthy(role)
        extra_calls = self.reserve_of(priority)
        bounds = [self.admission.bound_of(inst, extra_calls) for inst in healthy]
        if healthy and all(bound is not None for bound in bounds):
            total = sum(bound for bound in bounds if bound is not None)
            if num_calls > total:
                raise self.admission.calls_never_fit(role, num_calls, total, len(healthy))
        token_bounds = [self.admission.token_bound(inst) for inst in healthy]
        if not healthy or extra_calls or any(bound is None for bound in token_bounds):
            return
        total_tokens = sum(bound for bound in token_bounds if bound is not None)
        if num_tokens > total_tokens:
            raise self.admission.prompts_never_fit(role, num_tokens, total_tokens, len(healthy))

    def verdict(self, inst: Instance, failed: bool | None) -> None:
        """Feed a call's outcome to inst's breaker (None: no verdict: the caller left, or
        the worker refused the router with 401)."""
        breaker = self.breakers.get(inst.url)
        if failed is None:
            breaker.release_trial()
        elif failed:
            breaker.record_failure()
        else:
            breaker.record_success()
