"""Runtime: execute a schedule artifact inside megatron-core."""

import warnings

# megatron-core warns at import, in every process, that it falls back to torch without transformer-engine
# or NVIDIA apex; that is the expected setup on CPU and says nothing about the job. Filtered here, before
# any runtime module imports megatron-core, so every entry point that uses the runtime is spared them.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
