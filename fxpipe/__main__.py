"""`python -m fxpipe`: the command-line interface."""

from fxpipe.cli import main

raise SystemExit(main())
