"""verl_async: fully asynchronous RL post-training (Rollouter + Trainer joined by a MessageQueue).

Importing the package registers the OmegaConf resolvers the YAML config uses, so any
code that composes `config/` (Hydra, tests, scripts) can resolve it.
"""

from verl_async.config.resolvers import register_resolvers

register_resolvers()

__version__ = "0.1.0"
