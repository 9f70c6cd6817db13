from tests.workers.pool.fixtures import running_pool  # noqa: F401 (pytest fixture)
