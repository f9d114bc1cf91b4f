"""The context cache's logical side: the exact prefix index and the ResourceManager (DESIGN.md section 6)."""
