"""Runtime: execute a schedule artifact inside megatron-core."""

import logging
import warnings

# megatron-core warns at import, in every process, that it falls back to torch without
# transformer-engine or NVIDIA apex; that is the expected setup on CPU and says nothing about the
# job. Filtered here, before any runtime module imports megatron-core, so every entry point that
# uses the runtime is spared them.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning
)
# megatron-core's DDP buffers call torch's collectives under their pre-2.13 names, and its
# optimizer's zero_grad reads ``.grad`` of the distributed optimizer's shard views; neither is ours
# to change.
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
    r"is deprecated",
    category=FutureWarning,
)
warnings.filterwarnings(
    "ignore",
    message=r"The \.grad attribute of a Tensor that is not a leaf",
    category=UserWarning,
    module=r"megatron\.core\.optimizer",
)


class _NoCudaRuntimeNote(logging.Filter):
    """A CUDA build of torch on a host without CUDA logs, when megatron-core imports
    ``torch.utils.cpp_extension``, that it found no CUDA runtime: the expected CPU setup again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNote())
