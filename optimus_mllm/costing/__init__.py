"""The cost and memory models: what a kernel, a layer and a stage cost in time and
bytes, from the config alone (no torch)."""
