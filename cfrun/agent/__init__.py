"""The persist agent process: one per node, long-lived; persists snapshot slots and commits
checkpoints."""
