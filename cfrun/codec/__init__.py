"""The checkpoint codec (torch): tensors + JSON tree, shard files, manifests, sharding."""
