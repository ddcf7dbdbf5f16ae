"""``python -m torchfleet`` is the ``torchfleet`` command."""

from torchfleet.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
