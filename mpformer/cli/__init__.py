"""Console entry points: thin mains that compose the Hydra config and hand typed sections on.

Each main is wrapped in :func:`mpformer.core.errors.user_errors_to_exit`, so a user mistake
(ConfigError) becomes one line on stderr and exit code 2.
"""
