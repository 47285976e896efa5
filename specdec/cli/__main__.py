"""``python -m specdec.cli``: the `specdec` command, for a caller that runs it with a given interpreter (the
start-up bench, the server's load tests, scripts/soak.py)."""

from specdec.cli import main

if __name__ == "__main__":
    main()
