"""Recipes: Python functions that return winnow's typed configs, each built from another.

A recipe changes only what differs from the one it starts from, so a paper preset reads as
its diff against GRPO. NeMo-Run executors that launch these configs arrive with issue #9.
"""
