"""`python -m verl_async.sandbox`: the SandboxFusion-compatible server (server.py)."""

import sys

from verl_async.sandbox.server import main

sys.exit(main())
