"""ClusterSecrets: the keys of one launched cluster, and how each child gets its own.

    api_key          clients -> router, and clients -> a worker's /v1/*   (--api-key)
    admin_key        operators -> router admin API, /metrics, detailed /health; the same
                     on workers and the pool owner                       (--admin-key)
    internal_secret  router -> workers' /internal/*                      (--internal-secret)

The admin key and the internal secret are random per cluster unless given. Secrets reach a
child only through its environment (the flag's PDROUTER_*/PDWORKER_* mirror), never its
command line, which every user of the host can read (`ps`, /proc/<pid>/cmdline). The admin
key is also written to LOG_DIR/admin_key (mode 0600) for the operator.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.cli_args import env_name

ADMIN_KEY_FILE = "admin_key"
SECRET_FLAGS = {
    "api_key": "--api-key",
    "admin_key": "--admin-key",
    "internal_secret": "--internal-secret",
}


@dataclass(frozen=True)
class ClusterSecrets:
    api_key: str | None = field(default=None, repr=False)
    admin_key: str = field(default="", repr=False)
    internal_secret: str = field(default="", repr=False)

    @classmethod
    def create(
        cls, api_key: str | None, admin_key: str | None, internal_secret: str | None
    ) -> ClusterSecrets:
        return cls(
            api_key=api_key or None,
            admin_key=admin_key or secrets.token_urlsafe(32),
            internal_secret=internal_secret or secrets.token_urlsafe(32),
        )

    def env(self, names: tuple[str, ...], prefix: str) -> dict[str, str]:
        """The environment variables carrying the secrets names lists ("api_key", ...) to a
        command whose flags mirror prefix (PDROUTER_ or PDWORKER_); unset ones are left out."""
        out = {}
        for name in names:
            value = getattr(self, name)
            if value:
                out[env_name(SECRET_FLAGS[name], prefix)] = value
        return out

    def values(self) -> tuple[str, ...]:
        """Every secret that is set (what no command line may contain)."""
        return tuple(v for v in (self.api_key, self.admin_key, self.internal_secret) if v)

    def write_admin_key(self, log_dir: Path) -> Path:
        """LOG_DIR/admin_key, readable by this user alone (0600 from creation on)."""
        path = Path(log_dir) / ADMIN_KEY_FILE
        # A fresh file (O_EXCL): never write through a link or a file someone else created.
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.admin_key + "\n")
        return path
