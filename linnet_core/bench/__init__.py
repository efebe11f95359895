"""`linnet bench`: Linnet's backends and the stacks they replace, measured side by side in one run.

Each side runs in its own worker process (`worker.py`), so its load time is from a cold process
and its peak memory is its own; the parent (`run.py`) interleaves the timed runs across the
workers so that a drifting machine favours no side, then reports medians, ratios against
`transformers` eager from the same run, the decode roofline, and the page (`page.py`).
"""
