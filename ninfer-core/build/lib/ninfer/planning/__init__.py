"""Startup planning: everything an engine fixes before any large read (docs/design.md section 7).

- ``planner``: ``plan(artifact, options) -> StartupPlan``, the one planner (Engine.start, ``ninfer info
  --memory`` and ``ninfer bench`` use it).
- ``resolution``: EngineOptions resolved once for an artifact (``ResolvedOptions``).
- ``budget``: the device budget and headroom; ``MemoryPlanError``.
- ``memory``: the workspace estimate, the KV candidates and ``MemoryPlan``.
- ``calibration``: after the decode graphs are captured, the final KV capacity.
"""
