"""The engine and its surface: ``shardwise.initialize``, :class:`~.engine.Engine` (forward, backward, step), its
weights as files and dicts, DeepSpeed's getters, several engines saved together, and the checks of what users
hand it."""
