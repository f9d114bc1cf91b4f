"""The context cache's logical side: the exact prefix index, the ContextCache, when requests are checkpointed, and the one operation slot (docs/design.md section 6)."""
