"""``python -m gemini_ckpt``: ``status`` (:mod:`.status`), ``ls``/``verify`` (:mod:`.durable`);
``demo`` and ``chaos`` live in their own packages."""
