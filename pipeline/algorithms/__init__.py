"""Pure tensor functions of the RL algorithms: tensors in, ``(result, metrics)`` out.

Nothing here keeps state across steps, reads a config or touches ``torch.distributed``;
the RL loop's methods (``pipeline/rl/methods.py``, ``pipeline/rl/sampling.py``) bind their
options, keep their state and call these functions. Import the module you need, e.g.
``from pipeline.algorithms.d3s import d3s_cross_select``.
"""
