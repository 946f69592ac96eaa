"""The `edgespec` command line (entry point: edgespec.cli.app:main)."""
