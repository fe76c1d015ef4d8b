"""``cfrun peer``: the remote-memory staging node (ACUTE level 1).

``protocol`` the wire protocol both sides import (handshake, session keys, a MAC on every frame,
limits, :class:`~cfrun.peer.protocol.PeerClient`); ``gate`` admission (every handshake, its
deadline, the caps on unauthenticated connections); ``server`` the peer's accept loop and request
dispatch (``serve_main``); ``buffer`` the RAM circular buffer (slots, reservations, eviction);
``flusher`` the flush thread to level 2 (per-job queues served in turn); ``tenants`` the tokens
of several tenants and their namespaces.
"""
