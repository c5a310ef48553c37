"""What the tests share: launching ranks, training runs, artifacts, and the test oracles (the
schedule validity check, the randomized plan check and the input fuzzer)."""
