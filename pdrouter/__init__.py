"""pdrouter: the client-facing router of prefill/decode disaggregated serving.

Never imports Paddle: everything here works on plain ints, lists and HTTP.
"""

__version__ = "0.1.0"
