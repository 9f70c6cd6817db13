"""Mooncake codes -> KeyStatus -> typed errors; BatchResult's per-key views."""

from __future__ import annotations

import pytest

from workers.pool.errors import (
    TIMEOUT_CODE,
    BadParamsError,
    BatchResult,
    KeyMissingError,
    KeyStatus,
    LeaseHeldError,
    MasterUnreachableError,
    NotReadyError,
    PoolError,
    PoolFullError,
    PoolTimeoutError,
    TransferFailedError,
    error_class,
    status_for_code,
)


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        (-200, KeyStatus.POOL_FULL, PoolFullError),
        (-101, KeyStatus.POOL_FULL, PoolFullError),
        (-704, KeyStatus.MISSING, KeyMissingError),
        (-703, KeyStatus.NOT_READY, NotReadyError),
        (-706, KeyStatus.LEASE_HELD, LeaseHeldError),
        (-800, KeyStatus.TRANSFER_FAILED, TransferFailedError),
        (-900, KeyStatus.MASTER_UNREACHABLE, MasterUnreachableError),
        (-600, KeyStatus.BAD_PARAMS, BadParamsError),
        (TIMEOUT_CODE, KeyStatus.TIMEOUT, PoolTimeoutError),
        (-1, KeyStatus.ERROR, PoolError),
        (-1234, KeyStatus.ERROR, PoolError),
    ],
)
def test_code_mapping(code, status, error):
    assert status_for_code(code) is status
    assert error_class(status) is error
    assert issubclass(error, PoolError)


def test_success_codes():
    assert status_for_code(0) is KeyStatus.OK
    assert status_for_code(1 << 20) is KeyStatus.OK
    with pytest.raises(ValueError, match="not an error"):
        error_class(KeyStatus.OK)


def test_batch_result_views():
    result = BatchResult.from_codes(["a", "b", "c", "d"], [4096, -704, 4096, -200])
    assert not result.ok
    assert result.ok_keys == ["a", "c"]
    assert result.missing_keys == ["b"]
    assert result.failed_keys == ["b", "d"]
    assert result.keys_with(KeyStatus.POOL_FULL) == ["d"]
    assert result.statuses == (KeyStatus.OK, KeyStatus.MISSING, KeyStatus.OK, KeyStatus.POOL_FULL)
    err = result.error()
    # Pool full is more fundamental than a miss: it is the one raised.
    assert isinstance(err, PoolFullError)
    assert str(err) == "1/4 keys pool_full (code -200): d"
    with pytest.raises(PoolFullError):
        result.raise_for_error()


def test_master_unreachable_outranks_everything():
    keys = [f"k{i}" for i in range(5)]
    result = BatchResult.from_codes(keys, [-704, -900, -900, -900, -900])
    err = result.error()
    assert isinstance(err, MasterUnreachableError)
    assert str(err) == "4/5 keys master_unreachable (code -900): k1, k2, k3 and 1 more"


def test_all_ok_has_no_error():
    result = BatchResult.from_codes(["a"], [0])
    assert result.ok and result.error() is None
    result.raise_for_error()
    assert BatchResult.from_codes([], []).ok
    with pytest.raises(AssertionError, match="2 keys but 1 codes"):
        BatchResult.from_codes(["a", "b"], [0])
