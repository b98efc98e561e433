"""``python -m efdl`` is the ``efdl`` command."""

from efdl.cli import main

main()
