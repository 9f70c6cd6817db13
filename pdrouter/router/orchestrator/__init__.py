"""The PD flow: prefill stage, decode stage, the failure policy they share, the answer."""

from pdrouter.router.orchestrator.config import HopTimeouts, OrchestratorConfig
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.orchestrator import Orchestrator

__all__ = ["HopTimeouts", "Orchestrator", "OrchestratorConfig", "RequestContext"]
