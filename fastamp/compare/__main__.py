import sys

from fastamp.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
