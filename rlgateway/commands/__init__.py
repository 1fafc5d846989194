"""One module per `rlgateway` subcommand; each imports its heavy dependencies itself."""
