"""The supervisor process, one per node: launches torchrun and the persist agent, restarts,
signals."""
