"""Recipes: Python functions that return winnow's typed configs, each built from another.

A recipe changes only what differs from the one it starts from, so a paper preset reads as
its diff against GRPO. ``cpu.py``: RL presets on the CPU demo policy; ``stages.py``: stage
presets and their NeMo-Run ``run.Partial`` forms; ``campaigns.py``: whole campaigns (CPU and
H100) for ``winnow launch campaign``.
"""
