"""The V3 ``.ninfer`` artifact: framing, reader, binder, load plan and materializer (docs/artifact-v3.md)."""
