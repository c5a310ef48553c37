"""Runtime: execute a schedule artifact inside megatron-core."""
