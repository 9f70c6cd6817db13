"""A worker's identity on the wire: what its /health reports and what it registers with.

    worker                                    router
    ------                                    ------
    WorkerIdentity (built once after load)
      .health_body()   -> GET /health 200     WorkerHealth.model_validate_json (in
                                              pdrouter.router.instances.health): its
                                              fingerprint, block size, model, bounds and
                                              degraded reasons
      .registration(url, capacity)
                       -> POST /instances     InstanceRegistration.model_validate_json

Both sides import this module, so a field is named in one place; nothing is read back out of
a JSON dict by string keys on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Bounds on what a registration may claim: a body outside them is a broken or hostile caller.
MAX_URL_CHARS = 2048
MAX_FINGERPRINT_CHARS = 256

RegisteredRole = Literal["prefill", "decode"]
# How a P/D worker's handoff goes through the pool (workers/pool/handoff_path.py): through
# host staging or by device pointers; chosen once at start, with the reason.
HandoffPathName = Literal["host", "device"]
MAX_REASON_CHARS = 512


class InstanceRegistration(BaseModel):
    """The body of POST /instances (sent by workers started with --router)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: RegisteredRole
    url: str = Field(
        min_length=8, max_length=MAX_URL_CHARS, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$"
    )
    fingerprint: str = Field(min_length=1, max_length=MAX_FINGERPRINT_CHARS)
    block_size: int = Field(ge=1, le=1 << 20)
    model: str | None = Field(default=None, max_length=512)
    capacity: int | None = Field(default=None, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    # Its engine's batch (--max-num-seqs): the router's default in-flight bound follows it.
    max_num_seqs: int | None = Field(default=None, ge=1)
    # The longest sequence it serves: the router bounds request bodies by it (body_limit).
    max_model_len: int | None = Field(default=None, ge=1, le=1 << 30)
    handoff_path: HandoffPathName | None = None
    handoff_path_reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)
    # Its ranks and the model's KV heads. Neither enters the fingerprint (a pool object names
    # the heads it holds: workers of every TP size that divides the heads share blocks), but a
    # size that does not divide them could never name its shards: refused here, saying so.
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    num_kv_heads: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _heads_split(self) -> InstanceRegistration:
        tp, heads = self.tensor_parallel_size, self.num_kv_heads
        if heads is not None and heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's {heads} KV heads: its "
                "ranks could not hold whole head ranges, so no other worker could read its KV"
            )
        return self


class RegistrationAnswer(BaseModel):
    """What a worker learns from registering: its id and how often to heartbeat."""

    id: str
    heartbeat_ttl_s: float
    fingerprint: str


class WorkerHealth(BaseModel):
    """The body of a ready worker's GET /health (for a caller allowed the detail).

    The router's health check parses it (pdrouter.router.instances.health.check): a 200 whose
    body is not one fails the check.
    """

    # extra="ignore", unlike the request bodies here: the router reads what a worker says of
    # itself, and a newer worker that adds a field must still pass an older router's checks
    # (during a rolling upgrade), so a field the router does not know is dropped, not refused.
    model_config = ConfigDict(extra="ignore", frozen=True)

    # "degraded": serving, with a dependency down (the pool client reconnecting: the handoff
    # recomputes meanwhile); degraded names each such dependency and why.
    status: Literal["ok", "degraded"] = "ok"
    degraded: list[str] = Field(default_factory=list)
    role: str
    model: str
    served_model_names: list[str]
    fingerprint: str = Field(min_length=1, max_length=MAX_FINGERPRINT_CHARS)
    block_size: int = Field(ge=1)
    num_kv_blocks: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    handoff_path: HandoffPathName | None = None  # P and D workers
    handoff_path_reason: str | None = None
    tensor_parallel_size: int = 1
    num_kv_heads: int | None = None


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a loaded worker is: fixed once the engine has loaded, never changes after."""

    role: str  # mixed | prefill | decode
    served_model_names: tuple[str, ...]
    fingerprint: str  # the model fingerprint block keys are hashed with
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    handoff_path: HandoffPathName | None = None  # set by a P/D worker once its pool is up
    handoff_path_reason: str | None = None
    tensor_parallel_size: int = 1  # rank processes (workers/engine/tp/)
    num_kv_heads: int | None = None  # the model's

    @property
    def model(self) -> str:
        """The name the worker answers under first (what the router shows)."""
        return self.served_model_names[0]

    def health_body(self) -> WorkerHealth:
        return WorkerHealth(
            role=self.role,
            model=self.model,
            served_model_names=list(self.served_model_names),
            fingerprint=self.fingerprint,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            handoff_path=self.handoff_path,
            handoff_path_reason=self.handoff_path_reason,
            tensor_parallel_size=self.tensor_parallel_size,
            num_kv_heads=self.num_kv_heads,
        )

    def registration(self, url: str, capacity: int | None) -> InstanceRegistration:
        """The registration body of a P or D worker reachable at url."""
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a {self.role} worker does not register with a router")
        return InstanceRegistration(
            role=self.role,  # type: ignore[arg-type]  # checked just above
            url=url,
            fingerprint=self.fingerprint,
            block_size=self.block_size,
            model=self.model,
            capacity=capacity,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            handoff_path=self.handoff_path,
            handoff_path_reason=(self.handoff_path_reason or "")[:MAX_REASON_CHARS] or None,
            tensor_parallel_size=self.tensor_parallel_size,
            num_kv_heads=self.num_kv_heads,
        )
