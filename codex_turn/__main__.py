import sys

from codex_turn.cli import main

sys.exit(main())
