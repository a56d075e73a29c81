"""The parameters: slices and stores, the optimizer that updates them, the shards holding them."""
