"""The one backoff of cfrun: how long to wait before the next try after consecutive failures.

Torch-free. Used by the supervisor between restarts of the ranks
(:mod:`cfrun.supervisor.machine`) and by the persist agent before it tries an unreachable peer
again (:class:`cfrun.agent.peertier.PeerTier`): the base wait doubled per failure, capped, as
torchelastic's and most clients' exponential backoff.
"""

from __future__ import annotations

MAX_BACKOFF_S = 30.0
"""The longest wait before a retry, in seconds."""


def backoff_delay_s(base_s: float, attempt: int, max_s: float = MAX_BACKOFF_S) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): ``base_s`` doubled per
    retry, at most ``max_s`` (30 s); never overflows, however large ``attempt`` is."""
    return float(min(base_s * 2.0 ** min(attempt - 1, 1023), max_s))
