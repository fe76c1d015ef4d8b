"""``cfrun peer``: the remote-memory staging node (ACUTE level 1)."""
