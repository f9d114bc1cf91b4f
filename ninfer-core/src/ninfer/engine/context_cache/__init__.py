"""The context cache's logical side: the exact prefix index and the ContextCache (docs/design.md section 6)."""
