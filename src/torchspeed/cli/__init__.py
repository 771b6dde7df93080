"""The `torchspeed` command: one file per subcommand, each parsing flags and calling the public API."""
