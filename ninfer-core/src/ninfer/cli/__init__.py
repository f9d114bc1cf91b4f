"""The ``ninfer`` command. Each subcommand is one module here exposing ``register(subparsers)``."""
