"""Stop strings over a stream of text deltas.

`StopStringMatcher.push(delta)` returns the text that is safe to send and whether a stop string has
now occurred. Text that a stop string could still claim (the longest suffix of what has arrived that
is a prefix of some stop string) is held back, so a streamed response never sends part of a stop
string; on a match the matched string and anything after it are dropped (with `include`, vLLM's
`include_stop_str_in_output`, the matched string is kept: it ends the text). The earliest match wins
(ties: the shortest stop string at that position, which completes first). Per delta the cost is
O(held text x stop strings), the held text being shorter than the longest stop string plus the delta.
"""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include: bool = False):
        """`include`: a match keeps the stop string itself in the text (vLLM's `include_stop_str_in_output`); of
        stop strings that match at the same place, the shortest (it completes first)."""
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.include = include
        self.stops = tuple(stops)
        self._firsts = frozenset(s[0] for s in self.stops)
        self._longest = max(len(s) for s in self.stops)
        self.pending = ""  # arrived, not sent
        self.matched = False

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to send now, matched). After a match every further push returns ("", True)."""
        if self.matched:
            return "", True
        if not delta:
            return "", False
        buf = self.pending + delta
        hit, size = -1, 0
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (hit == -1 or i < hit or (i == hit and len(s) < size)):
                hit, size = i, len(s)
        if hit != -1:
            self.pending, self.matched = "", True
            return buf[:hit + size if self.include else hit], True
        keep = self._claimable(buf)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text (the sequence ended without a match)."""
        out, self.pending = self.pending, ""
        return "" if self.matched else out

    def _claimable(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        start = max(0, len(buf) - self._longest + 1)
        for i in range(start, len(buf)):  # earliest start = longest suffix
            if buf[i] in self._firsts:
                tail = buf[i:]
                if any(s.startswith(tail) for s in self.stops):
                    return len(buf) - i
        return 0
