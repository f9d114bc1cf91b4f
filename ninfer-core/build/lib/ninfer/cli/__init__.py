"""The ``ninfer`` command: :mod:`main` dispatches to the :class:`~ninfer.cli.command.CliCommand` values every
plugin registers (core's own, one module each, through :mod:`ninfer.cli.plugin`); :mod:`common` holds the flags
and option builders the model-running commands share."""
