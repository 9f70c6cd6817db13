from tests.workers.pool.fixtures import actors, running_pool  # noqa: F401 (pytest fixtures)
