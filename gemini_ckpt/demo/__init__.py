"""``python -m gemini_ckpt demo`` (the optional extra ``gemini_ckpt[demo]``: matplotlib draws
its timeline). Its model and data are :mod:`gemini_ckpt.toy`'s, which the examples, the chaos
harness, tests and benchmarks share. Importing this package imports nothing."""
