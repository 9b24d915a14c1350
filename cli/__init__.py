"""The `metrale-jax` command line (installed as the `metrale_jax_cli` package)."""
