"""``python -m embedfleet.shared.settings [--write [PATH]]``: print or write the settings table."""

import sys

from embedfleet.shared.settings.table import main

main(sys.argv[1:])
