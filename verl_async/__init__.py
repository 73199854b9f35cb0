"""verl_async: fully asynchronous RL post-training (Rollouter + Trainer joined by a MessageQueue).

Importing the package registers the OmegaConf resolvers the YAML config uses, so any
code that composes `config/` (Hydra, tests, scripts) can resolve it.
"""

import time

IMPORTED_AT = time.time()  # a process's first import of the package: where its start-up imports begin (utils/startup.py)

from verl_async.config.resolvers import register_resolvers  # noqa: E402

register_resolvers()

__version__ = "0.1.0"
