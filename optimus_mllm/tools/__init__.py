"""Tools beside training: optimus-profile's kernel measurements (``profiler``) and
Hugging Face checkpoints to megatron-core's (``hf_convert``)."""
