"""``python -m banyan ...``: the ``banyan`` command (for environments without the script on PATH)."""

from banyan.cli import main

main()
