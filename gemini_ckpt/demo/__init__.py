"""``python -m gemini_ckpt demo`` (the optional extra ``gemini_ckpt[demo]``: matplotlib draws
its timeline) and the small training setup the demo, the examples, tests and benchmarks share
(:mod:`.toy`). Importing this package imports nothing."""
