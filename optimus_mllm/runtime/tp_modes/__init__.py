"""Tensor parallelism that partitions activations as well as weights (issue 36, in progress).

- ``layout``: which ranks form the rows and columns of a q x q grid (2D, SUMMA) and the three
  directions of a p x p x p cube (3D). Pure arithmetic, no torch, so the planner may import it.
- ``groups``: the ``torch.distributed`` groups of a grid or a cube, built from ``layout``.
- ``summa``: the 2D paper's matrix products (its Algorithms 1-3) as autograd functions.
- ``layers_2d``: megatron-core layer modules (linear, layer norm) on a grid, and the
  ``TransformerLayer`` spec that uses them.
- ``layers_3d``: the 3D paper's load-balanced linear layer (its Algorithms 1-2), the diagonal
  hosting of vectors (Algorithms 7-8), its layer norm, and the ``TransformerLayer`` spec.

- ``linear_args``: megatron-core's linear constructor keywords, which the 2D and 3D linears take,
  and the refusal of those they do not build.
- ``params``: how the 2D and 3D layers' blocks are initialised and marked for megatron-core's
  optimizer (each held by one rank).
- ``model``: a whole model (input projection, ``TransformerBlock``, classification head) in any
  mode, 1d, 2d, 3d or metp, that megatron-core's DDP and optimizer train like its 1D twin.
- ``trained``: which TP modes the runtime trains (1d; metp and 2d for the encoder) and the
  refusal of the others.

Built: the 2D and 3D transformer layers, and whole models in every mode; planned by the config,
memory and cost models and the planner (``optimus_mllm/costing/tp_footprint.py``, ``tp_memory.py``,
``cost_model.py``, outside the runtime so that the planner reads them without torch). Not built:
the embedding and output layers partitioned the papers' way (``model``'s are replicated), and the
runtime's LLM in these modes and its encoder in 3d (METP and 2D encoders train: ``runtime/vit``,
``layer_ops``).
This package imports nothing at import time, so ``layout`` stays torch-free.
"""
