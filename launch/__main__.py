"""`python -m launch ...` is the `graphline` command."""
from launch.cli import main

raise SystemExit(main())
