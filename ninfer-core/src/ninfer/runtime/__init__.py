"""Runtime: contracts between Engine, Scheduler, Program and Frontend, and the engine itself."""
