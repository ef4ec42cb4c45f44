"""`python -m streamrl ...`: the `streamrl` command (torchrun and the launcher start roles this way)."""

from streamrl.cli import main

main()
