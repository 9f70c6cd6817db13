"""What each direction of the handoff waited on, in seconds: one dataclass per direction,
named as the wire reports it (pdrouter.wire.pd.PrefillTimings, DecodeTimings), so no layer
renames a stage.

    P  WriteTimings   d2h_s  swap_cache_layout device -> host into staging slots
                      put_s  pool exists() + put_from
    D  ReadTimings    get_s  pool get_into staging slots
                      h2d_s  swap_cache_layout host -> device

With the group pipeline the stages overlap; each is the time the calling thread waited on
it, so together they are about the wall time (the hidden part is gone).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WriteTimings:
    d2h_s: float = 0.0
    put_s: float = 0.0

    def __add__(self, other: WriteTimings) -> WriteTimings:
        return WriteTimings(self.d2h_s + other.d2h_s, self.put_s + other.put_s)


@dataclass(frozen=True)
class ReadTimings:
    get_s: float = 0.0
    h2d_s: float = 0.0

    def __add__(self, other: ReadTimings) -> ReadTimings:
        return ReadTimings(self.get_s + other.get_s, self.h2d_s + other.h2d_s)
