"""Where versions live: shards in memory (this process's, :mod:`.memory`; the host stores' are
:mod:`gemini_ckpt.hoststore`; the durable tier's are :mod:`gemini_ckpt.durable`). :mod:`.base` says what a tier is (the extension point);
:mod:`.views` is what a tier's ``open(step)`` returns and restore reads. Only the views import
torch (lazily, when a version is opened); importing this package imports nothing.
"""
