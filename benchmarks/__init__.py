"""Measurements of pdserve (each script prints its numbers and writes them with --json; benchmarks/RESULTS.md
keeps them with their commands); cli.py is the command line they share. What users run is in tools/."""
