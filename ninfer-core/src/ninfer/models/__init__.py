"""Model-side code shared by the architecture plugins (``common``): frontends, context storage, MoE."""
