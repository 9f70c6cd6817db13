"""The PD flow: prefill on a P (with failover), then decode on a D (relayed), the answer.

    client ─► router ─► P  POST /internal/prefill   retried on another P before its result
                    ◄── PrefillResult (first token, KV handle)
             ◄─ first token (stream: at once)
                    ─► D  POST /internal/decode     another D if one cannot be reached;
                    ◄── DecodeEvent stream           resumed on another D if it dies mid-stream
             ◄─ relayed tokens, usage = prompt side from P + completion side from D

One room per part: the stages (prefill.py, decode.py) share the attempt loop and the attempt
itself (attempts.py: hold, guard, request, verdict) and the failure policy (failures.py);
answer.py builds what the client gets. Each takes what it uses: a stage its Hop (the role's
path, bounds and attempts, and the selection, registry, metrics and upstream client behind
its calls). The app's service (pdrouter.router.service) builds the two hops once and calls
prefill(), then Answers.stream() or Answers.complete().
"""

from pdrouter.router.orchestrator.answer import Answers
from pdrouter.router.orchestrator.attempts import Hop
from pdrouter.router.orchestrator.config import HopTimeouts, OrchestratorConfig
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.prefill import prefill

__all__ = ["Answers", "Hop", "HopTimeouts", "OrchestratorConfig", "RequestContext", "prefill"]
