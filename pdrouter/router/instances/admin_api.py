"""Admin endpoints over the registry: list, register, heartbeat, drain, remove.

    GET    /instances                     every instance with its health, load, drain state
    GET    /instances/{id}                one of them
    POST   /instances                     a worker registers (role, URL, fingerprint, ...);
                                          201 new, 200 already known (same id), 409 mismatch
    PUT    /instances/{id}/heartbeat      the worker is alive; 404 -> it registers again
    POST   /instances/{id}/drain          no new requests; in-flight ones finish
    POST   /instances/{id}/undrain        back in rotation
    DELETE /instances/{id}                removed (its in-flight requests still finish);
           /instances/{id}?if_drained=true  409 while it still has requests in flight

Every one needs `Authorization: Bearer <admin key>` when the router has one (401 otherwise).
Handlers stay thin: the registry holds the rules, errors leave in the router's one error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pdrouter.common.auth import require_bearer
from pdrouter.router.instances.instance import FingerprintMismatch, RegistrationConflict
from pdrouter.router.instances.registry import Registry
from pdrouter.wire.errors import APIError
from pdrouter.wire.worker import InstanceRegistration, RegistrationAnswer


def _not_found(instance_id: str) -> APIError:
    return APIError(
        404, f"no instance with id {instance_id!r}", "invalid_request_error", code="not_found"
    )


def _parse_registration(raw: bytes) -> InstanceRegistration:
    try:
        return InstanceRegistration.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(
            400, f"invalid registration: {first['msg']}", "invalid_request_error", param
        ) from None


def install_instances_routes(
    app: FastAPI, registry: Registry, admin_key: str | None, heartbeat_ttl_s: float
) -> None:
    """Add the /instances endpoints to the router app."""

    def admin(request: Request) -> None:
        require_bearer(request.headers.get("authorization"), admin_key, "admin key")

    def one(instance_id: str) -> dict[str, Any]:
        inst = registry.get(instance_id)
        if inst is None:
            raise _not_found(instance_id)
        return registry.describe_instance(inst)

    @app.get("/instances")
    async def list_instances(request: Request) -> dict[str, Any]:
        admin(request)
        return {"fingerprint": registry.fingerprint, "instances": registry.snapshot()}

    @app.get("/instances/{instance_id}")
    async def get_instance(request: Request, instance_id: str) -> dict[str, Any]:
        admin(request)
        return one(instance_id)

    @app.post("/instances")
    async def register(request: Request) -> JSONResponse:
        admin(request)
        reg = _parse_registration(await request.body())
        try:
            inst, is_new = registry.register(
                reg.role,
                reg.url,
                reg.fingerprint,
                reg.block_size,
                reg.model,
                reg.capacity,
                reg.num_kv_blocks,
                reg.max_model_len,
                reg.max_num_seqs,
            )
        except FingerprintMismatch as exc:
            raise APIError(
                409, str(exc), "invalid_request_error", "fingerprint", "fingerprint_mismatch"
            ) from None
        except RegistrationConflict as exc:
            raise APIError(409, str(exc), "invalid_request_error", "url", "conflict") from None
        answer = RegistrationAnswer(
            id=inst.instance_id, heartbeat_ttl_s=heartbeat_ttl_s, fingerprint=reg.fingerprint
        )
        return JSONResponse(answer.model_dump(), status_code=201 if is_new else 200)

    @app.put("/instances/{instance_id}/heartbeat")
    async def heartbeat(request: Request, instance_id: str) -> dict[str, Any]:
        admin(request)
        if registry.heartbeat(instance_id) is None:
            raise _not_found(instance_id)
        return one(instance_id)

    @app.post("/instances/{instance_id}/drain")
    async def drain(request: Request, instance_id: str) -> dict[str, Any]:
        admin(request)
        if registry.set_draining(instance_id, True) is None:
            raise _not_found(instance_id)
        return one(instance_id)

    @app.post("/instances/{instance_id}/undrain")
    async def undrain(request: Request, instance_id: str) -> dict[str, Any]:
        admin(request)
        if registry.set_draining(instance_id, False) is None:
            raise _not_found(instance_id)
        return one(instance_id)

    @app.delete("/instances/{instance_id}")
    async def remove(
        request: Request, instance_id: str, if_drained: bool = False
    ) -> dict[str, Any]:
        admin(request)
        inst = registry.get(instance_id)
        if inst is None:
            raise _not_found(instance_id)
        described = registry.describe_instance(inst)
        if if_drained and not described["drained"]:
            state = "draining" if inst.draining else "not draining"
            raise APIError(
                409,
                f"instance {instance_id} is {state} with {inst.in_flight} requests in flight; "
                f"drain it (POST /instances/{instance_id}/drain) and retry once they finish",
                "invalid_request_error",
                "if_drained",
                "not_drained",
            )
        registry.remove(instance_id)
        return described
