import sys

try:
    from edgespec.cli import main
except KeyboardInterrupt:  # Ctrl-C while still importing: the same exit code as later on
    sys.exit(130)

sys.exit(main())
