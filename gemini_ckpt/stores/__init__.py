"""Where versions live: shards in memory (this process's or the host stores'), and the
durable tier. :mod:`.shards` is torch-free (host stores import it); importing this package
imports nothing.
"""
