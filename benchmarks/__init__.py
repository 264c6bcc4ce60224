"""Side-by-side benchmarks: shardwise ZeRO stages against the torch peers a user would pick.

``python -m benchmarks.run`` trains the same GPT (``examples/gpt.py``) on the same
synthetic data from the same seed with every configuration, on gloo ranks, and
writes a markdown table, a JSON file and (with matplotlib) a PNG chart.  See
``docs/benchmarks.md`` for what is measured and how.
"""
