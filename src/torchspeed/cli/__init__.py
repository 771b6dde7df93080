"""The `torchspeed` command: per subcommand X, `X.py` builds its parser and `X_run.py`, imported when X runs, checks
the flags and calls the public API (main.py: `COMMANDS`, `RUNNERS`; launch is one module)."""
