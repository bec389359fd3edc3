"""``python -m headroom``: the ``headroom`` command."""

from headroom.cli import main

main()
