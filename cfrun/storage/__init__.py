"""Storage tiers behind one interface, chosen by URL (local directory, fsspec)."""
