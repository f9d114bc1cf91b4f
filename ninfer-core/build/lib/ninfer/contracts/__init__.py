"""Frozen contracts shared by the engine, the architecture plugins and the frontends."""
