"""A registration states its TP size and KV heads; a size that cannot split the heads is
refused with the reason, and neither field touches the fingerprint the router compares."""

from __future__ import annotations

import json

import pytest

from pdrouter.router.instances.admin_api import _parse_registration
from pdrouter.wire.errors import APIError
from pdrouter.wire.worker import WorkerIdentity

IDENTITY = WorkerIdentity(role="prefill", served_model_names=("tiny",), fingerprint="f" * 16,
                          block_size=16, num_kv_blocks=64, max_model_len=1024, max_num_seqs=8,
                          tensor_parallel_size=2, num_kv_heads=8)  # fmt: skip


def test_a_tp_worker_registers_its_size_and_heads() -> None:
    body = IDENTITY.registration("http://127.0.0.1:9000", 4).model_dump_json()
    reg = _parse_registration(body.encode())
    assert (reg.tensor_parallel_size, reg.num_kv_heads, reg.fingerprint) == (2, 8, "f" * 16)
    assert IDENTITY.health_body().tensor_parallel_size == 2


def test_a_size_that_does_not_divide_the_heads_is_refused_saying_why() -> None:
    body = json.loads(IDENTITY.registration("http://127.0.0.1:9000", 4).model_dump_json())
    body["tensor_parallel_size"] = 3
    with pytest.raises(APIError) as refused:
        _parse_registration(json.dumps(body).encode())
    assert refused.value.status == 400
    assert "tensor_parallel_size 3 does not divide the model's 8 KV heads" in refused.value.message
